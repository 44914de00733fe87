"""Constants shared by the model, data and checkpoint code."""

IMAGE_TOKEN = "<image>"
"""The placeholder users write in prompts; a special token of every neva tokenizer."""

VIDEO_TOKEN = "<video>"
"""A video's placeholder in prompts (LLaVA-Video's and transformers' LlavaNextVideoProcessor's)."""

IGNORE_INDEX = -100
"""Label of positions that are not learned (HF / PyTorch cross-entropy convention)."""

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SIGLIP_MEAN = (0.5, 0.5, 0.5)  # SiglipImageProcessor's IMAGENET_STANDARD_MEAN / _STD
SIGLIP_STD = (0.5, 0.5, 0.5)

MAX_IMAGE_PIXELS = 64_000_000
"""Default ``model.data.max_image_pixels``: larger images are skipped before decoding (well above any real photo;
one 144-megapixel image would otherwise take about 1 GB for one sample)."""
