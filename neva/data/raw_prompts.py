"""Raw prompts (``neva.generate --raw``): a prompt used as given, as the model family's HF processor takes it.

Each ``<image>`` / ``<video>`` tag is written as the family's own placeholder and expanded to its item's positions,
then the text is tokenized in one call with the tokenizer's special tokens: LLaVA's ``<image>`` (``LlavaProcessor``,
BOS added), or for a model whose image token is Qwen-VL's ``<|image_pad|>`` its vision block
``<|vision_start|><|image_pad|><|vision_end|>`` (the Qwen2-VL processor), which a prompt may also hold as it is.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from neva.constants import IMAGE_TOKEN, VIDEO_TOKEN
from neva.data.templates.qwen_vl import QWEN_IMAGE_BLOCK, QWEN_IMAGE_PAD, QWEN_VIDEO_BLOCK

QWEN_VIDEO_PAD = "<|video_pad|>"


def uses_qwen_blocks(tokenizer: Any, image_token_id: int) -> bool:
    """Whether the model's image token is Qwen-VL's ``<|image_pad|>`` (its images are vision blocks)."""
    return tokenizer.get_vocab().get(QWEN_IMAGE_PAD) == image_token_id


def raw_prompt_ids(
    tokenizer: Any,
    prompt: str,
    image_token_id: int,
    images: Iterator[int],
    videos: Iterator[int],
    num_images: int,
    num_videos: int = 0,
    video_tag: str = VIDEO_TOKEN,
    image_block: str | None = None,
) -> list[int]:
    """Token ids of a raw prompt; ``images`` / ``videos``: each item's positions in tag order; ``video_tag``: what a
    LLaVA model's ``<video>`` is written as (its video token); ``image_block``: what an ``<image>`` becomes with its
    one image token expanded, where the family's processor writes more than the token (Gemma 3's
    ``\n\n<start_of_image>`` … ``<end_of_image>\n\n``).

    Raises:
        ValueError: the prompt's placeholders do not match the images / videos given.
    """
    if uses_qwen_blocks(tokenizer, image_token_id):
        prompt = prompt.replace(IMAGE_TOKEN, QWEN_IMAGE_BLOCK).replace(VIDEO_TOKEN, QWEN_VIDEO_BLOCK)
        tags = {QWEN_IMAGE_PAD: (num_images, "image", images), QWEN_VIDEO_PAD: (num_videos, "video", videos)}
        found = "{n} {what} placeholder(s) (<{what}> or Qwen's vision block with {tag})"
    else:
        tags = {IMAGE_TOKEN: (num_images, "image", images), VIDEO_TOKEN: (num_videos, "video", videos)}
        found = "{n} {tag} tag(s)"
    for tag, (given, what, _) in tags.items():
        if prompt.count(tag) != given:
            raise ValueError(
                f"prompt has {found.format(n=prompt.count(tag), what=what, tag=tag)} but {given} {what}(s) were given"
            )
    written = {IMAGE_TOKEN: IMAGE_TOKEN, VIDEO_TOKEN: video_tag, QWEN_IMAGE_PAD: QWEN_IMAGE_PAD}
    written[QWEN_VIDEO_PAD] = QWEN_VIDEO_PAD

    def expand(tag: str, count: int) -> str:
        if tag == IMAGE_TOKEN and image_block is not None:
            token = tokenizer.convert_ids_to_tokens(image_token_id)
            return image_block.replace(token, token * count)
        return written[tag] * count

    pieces = re.split("(" + "|".join(re.escape(t) for t in tags) + ")", prompt)
    text = "".join(expand(p, next(tags[p][2])) if p in tags else p for p in pieces)
    return list(tokenizer(text).input_ids)
