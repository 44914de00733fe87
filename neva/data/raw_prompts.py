"""Raw prompts (``neva.generate --raw``): a prompt used as given, as the model family's HF processor takes it.

Each ``<image>`` / ``<video>`` tag is written as the family's own placeholder and expanded to its item's positions,
then the text is tokenized in one call with the tokenizer's special tokens: LLaVA's ``<image>`` (``LlavaProcessor``,
BOS added), or for a model whose image token is that of a template with ``raw_blocks`` (Qwen-VL's ``<|image_pad|>``)
that template's vision blocks (``<|vision_start|><|image_pad|><|vision_end|>``, the Qwen2-VL processor's), which a
prompt may also hold as they are.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from neva.constants import IMAGE_TOKEN, VIDEO_TOKEN
from neva.data.templates.base import Template
from neva.data.templates.registry import TEMPLATE_CLASSES


def raw_blocks_of(tokenizer: Any, image_token_id: int) -> type[Template] | None:
    """The template whose vision blocks a raw prompt is written in (``Template.raw_blocks``): the one whose image token
    is the model's (by the tokenizer: a checkpoint records its template, but not every one); None: LLaVA's tags."""
    vocab = tokenizer.get_vocab()
    found = (t for t in TEMPLATE_CLASSES.values() if t.raw_blocks and vocab.get(t.image_token) == image_token_id)
    return next(found, None)


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
    blocks = raw_blocks_of(tokenizer, image_token_id)
    if blocks is not None:
        prompt = prompt.replace(IMAGE_TOKEN, blocks.image_block).replace(VIDEO_TOKEN, blocks.video_block)
        tags = {blocks.image_token: (num_images, "image", images), blocks.video_token: (num_videos, "video", videos)}
        found = "{n} {what} placeholder(s) (<{what}> or the vision block with {tag})"
    else:
        tags = {IMAGE_TOKEN: (num_images, "image", images), VIDEO_TOKEN: (num_videos, "video", videos)}
        found = "{n} {tag} tag(s)"
    for tag, (given, what, _) in tags.items():
        if prompt.count(tag) != given:
            raise ValueError(
                f"prompt has {found.format(n=prompt.count(tag), what=what, tag=tag)} but {given} {what}(s) were given"
            )
    written = {VIDEO_TOKEN: video_tag}  # every other placeholder is written as itself

    def expand(tag: str, count: int) -> str:
        if tag == IMAGE_TOKEN and image_block is not None:
            token = tokenizer.convert_ids_to_tokens(image_token_id)
            return image_block.replace(token, token * count)
        return written.get(tag, tag) * count

    pieces = re.split("(" + "|".join(re.escape(t) for t in tags) + ")", prompt)
    text = "".join(expand(p, next(tags[p][2])) if p in tags else p for p in pieces)
    return list(tokenizer(text).input_ids)
