"""Qwen-VL's conversation templates (Qwen2-VL / Qwen2.5-VL: ``qwen2_vl``; Qwen3-VL: ``qwen3_vl``; named by their tower
specs, ``neva.families.qwen_vl``): ChatML with each ``<image>`` tag written as Qwen's vision block."""

from __future__ import annotations

import json

from neva.constants import IMAGE_TOKEN
from neva.data.templates.generic import ChatMLTemplate

QWEN_IMAGE_PAD = "<|image_pad|>"  # Qwen-VL's image token
QWEN_IMAGE_BLOCK = f"<|vision_start|>{QWEN_IMAGE_PAD}<|vision_end|>"
"""What an image tag is in Qwen-VL's text: its ``<|image_pad|>`` is the model's image token."""
QWEN_VIDEO_PAD = "<|video_pad|>"  # its video token
QWEN_VIDEO_BLOCK = f"<|vision_start|>{QWEN_VIDEO_PAD}<|vision_end|>"


class QwenVLTemplate(ChatMLTemplate):
    """Qwen2-VL / Qwen2.5-VL's ChatML, as their chat template renders a conversation of strings (a system turn
    "You are a helpful assistant." when none is given) and as Qwen's ``qwen-vl-finetune`` trainer turns LLaVA-format
    records into it: each ``<image>`` tag becomes ``<|vision_start|><|image_pad|><|vision_end|>`` in place, the
    ``<|image_pad|>`` then expanded to the image's positions like any image token (``neva.data.encoding``)."""

    name = "qwen2_vl"
    default_system = "You are a helpful assistant."
    image_block = QWEN_IMAGE_BLOCK
    image_token = QWEN_IMAGE_PAD
    # What a served prompt's ``<video>`` tag is written as (``neva.inference.PromptBuilder``); training's video tags
    # reach the template as ``<image>`` tags and get their video token after encoding (``neva.data.front_ends``).
    video_block = QWEN_VIDEO_BLOCK
    video_token = QWEN_VIDEO_PAD
    raw_blocks = True  # the Qwen2-VL processor: a prompt's vision blocks, counted by their pad tokens
    # ChatML with each <image> tag Qwen's vision block; qwen3_vl differs in its default system prompt only.
    jinja_body = (
        "{%- if system -%}{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] | replace(IMAGE_TOKEN, "
        + json.dumps(QWEN_IMAGE_BLOCK)
        + ")) + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )

    def pieces(self, messages, system):
        # The newline after a reply's <|im_end|> is learned too: qwen-vl-finetune labels `ans_start : ans_end + 2`,
        # the reply, <|im_end|> and the token after it (QwenLM/Qwen2.5-VL qwen-vl-finetune/qwenvl/data/
        # data_processor.py, preprocess_qwen_visual; its earlier preprocess_qwen_2_visual learned each assistant
        # turn's chat-template encoding, `<|im_end|>\n` included, but its first three tokens). ChatML's LLaVA-style
        # trainers (chatml) learn up to <|im_end|> only.
        out, after_reply = [], False
        for text, learned in super().pieces(messages, system):
            out.append((text.replace(IMAGE_TOKEN, QWEN_IMAGE_BLOCK), learned or (after_reply and text == "\n")))
            after_reply = learned and text == self.eot
        return out


class Qwen3VLTemplate(QwenVLTemplate):
    """Qwen3-VL's: the same blocks, no system turn unless one is given (its chat template adds none)."""

    name = "qwen3_vl"
    default_system = None
