"""GLM-4.1V's conversation template (``glm4v``; named by its tower spec, ``neva.families.glm4v``)."""

from __future__ import annotations

import json

from neva.constants import IMAGE_TOKEN
from neva.data.templates.base import USER, Template

GLM4V_IMAGE = "<|image|>"  # GLM-4.1V's image token (Glm4vProcessor's ``image_token``)
_IMAGE_BLOCK = f"<|begin_of_image|>{GLM4V_IMAGE}<|end_of_image|>"


class Glm4vTemplate(Template):
    """GLM-4.1V's format as LLaMA-Factory's ``glm4v`` template writes it (src/llamafactory/data/template.py:
    prefix ``[gMASK]<sop>``, ``<|system|>\n{s}``, ``<|user|>\n{q}``, ``<|assistant|>\n{a}``, and the tokenizer's EOS
    ``<|endoftext|>`` learned after each reply (``efficient_eos``)), which is also how the hub's chat template renders
    a conversation of strings up to the end of turn. Each ``<image>`` tag becomes
    ``<|begin_of_image|><|image|><|end_of_image|>`` in place, the ``<|image|>`` then expanded to the image's
    positions (``Glm4vProcessor``'s ``image_token``) like any image token (``neva.data.encoding``)."""

    name = "glm4v"
    eot = "<|endoftext|>"
    assistant_cue = "<|assistant|>\n"
    image_block = _IMAGE_BLOCK
    image_token = GLM4V_IMAGE
    # Each <image> tag its image block, the EOS learned after each reply.
    jinja_body = (
        "{{- '[gMASK]<sop>' -}}{%- if system -%}{{- '<|system|>\\n' + system -}}{%- endif -%}"
        "{%- for m in messages -%}{%- set content = m['content'] | replace(IMAGE_TOKEN, "
        + json.dumps(_IMAGE_BLOCK)
        + ") -%}"
        "{%- if m['role'] == 'user' -%}{{- '<|user|>\\n' + content -}}"
        "{%- elif m['role'] == 'assistant' -%}{{- '<|assistant|>\\n' + content + '<|endoftext|>' -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
    )

    def pieces(self, messages, system):
        out = [("[gMASK]<sop>" + (f"<|system|>\n{system}" if system else ""), False)]
        for m in messages:
            content = m.content.replace(IMAGE_TOKEN, self.image_block)
            if m.role == USER:
                out.append((f"<|user|>\n{content}", False))
            else:
                out += [("<|assistant|>\n", False), (content, True), (self.eot, True)]
        return out
