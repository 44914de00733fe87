"""A tiny GLM-4.1V directory as the hub ships one (transformers' ``Glm4vForConditionalGeneration``, random fp32
weights, a byte-level tokenizer with GLM's special tokens, ``Glm4vImageProcessorPil`` at a small pixel budget),
written in the test: the oracle of the GLM-4.1V import, data path, generation and export.

14-px patches merged 2×2 (28 px per token); the budget 1 to 12 tokens counted over the two frames an image is
repeated to; a 4×4 learned position table (56 px / 14) resampled to every image's grid; biased q / k / v in the
tower (HF's default has none: the bias keys are exercised); a decoder whose 16-wide heads rotate their first half
(``partial_rotary_factor`` 0.5: 4 frequencies, M-RoPE section [2, 1, 1]) in GLM's interleaved pairs."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.hf_oracle import randomise_inits

SPECIALS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|endoftext|>", "<|begin_of_image|>",
            "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|video|>"]  # fmt: skip
PATCH, MERGE = 14, 2
MIN_PIXELS, MAX_PIXELS = 2 * 28 * 28, 2 * 28 * 28 * 12
VOCAB = 416
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1], partial_rotary_factor=0.5))  # fmt: skip
VISION = dict(depth=2, hidden_size=32, num_heads=2, out_hidden_size=64, intermediate_size=48, image_size=56,
              patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, attention_bias=True,
              hidden_act="silu")  # fmt: skip


def glm4v_tokenizer():
    """neva's synthetic byte-level tokenizer with GLM-4.1V's special tokens (ids 400 on), no BOS,
    ``<|endoftext|>`` as EOS."""
    from neva.data.synthetic import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok._tokenizer.post_processor = None  # GLM's text carries [gMASK]<sop> itself; the tokenizer adds nothing
    tok.eos_token = "<|endoftext|>"
    return tok


def tiny_glm4v_dir(root: Path, seed: int = 0) -> Path:
    """Write the directory; returns its path."""
    import transformers

    tok = glm4v_tokenizer()
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image|>"), ("video_token_id", "<|video|>"),
        ("image_start_token_id", "<|begin_of_image|>"), ("image_end_token_id", "<|end_of_image|>"),
        ("video_start_token_id", "<|begin_of_video|>"), ("video_end_token_id", "<|end_of_video|>"))}  # fmt: skip
    torch.manual_seed(seed)
    config = transformers.Glm4vConfig(text_config=TEXT, vision_config=VISION, **ids)
    model = transformers.Glm4vForConditionalGeneration(config).eval()
    randomise_inits(model)
    with torch.no_grad():  # unit-scale tower activations: the blocks' share of the features stays visible
        for name, p in model.named_parameters():
            if "visual" in name and name.endswith("weight") and p.dim() > 1:
                p.mul_(8)
    out = root / "glm4v"
    model.save_pretrained(str(out))
    image_processor().save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def image_processor(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS):
    from transformers import Glm4vImageProcessorPil

    return Glm4vImageProcessorPil(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, patch_size=PATCH, merge_size=MERGE
    )


def hf_inputs(tokenizer, processor, text: str, images: list) -> dict:
    """What ``Glm4vProcessor`` gives (its class needs torchvision for videos, so its steps here): each ``<|image|>``
    repeated t·h·w / merge² times, the PIL image processor's pixels and grids, the token kinds (1: image)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    out = {}
    image = tokenizer.convert_tokens_to_ids("<|image|>")
    if images:
        out = dict(processor(images=images, return_tensors="pt"))
        counts = iter((out["image_grid_thw"].prod(-1) // MERGE**2).tolist())
        ids = [x for i in ids for x in ([image] * next(counts) if i == image else [i])]
    ids = torch.tensor([ids])
    return {"input_ids": ids, "mm_token_type_ids": (ids == image).long(), **out}
