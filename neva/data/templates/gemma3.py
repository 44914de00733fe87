"""Gemma 3's conversation template (``gemma3``; named by its decoder spec, ``neva.families.gemma3``)."""

from __future__ import annotations

from neva.constants import IMAGE_TOKEN
from neva.data.templates.base import USER, Template

GEMMA3_IMAGE = "<image_soft_token>"  # Gemma 3's image token (Gemma3Processor's ``image_token``)


class Gemma3Template(Template):
    """Gemma 3's chat template (google/gemma-3-*-it ``tokenizer_config.json``):
    ``<start_of_turn>user\n{q}<end_of_turn>\n<start_of_turn>model\n{a}<end_of_turn>\n``, a system prompt leading
    the first user turn (``{s}\n\n``), BOS from the tokenizer. A turn with ``<image>`` tags is the template's
    content list (text, image, text, ...): each text part trimmed, each image its ``<start_of_image>``, which
    ``Gemma3Processor`` expands to ``\n\n<start_of_image>`` + the image's tokens + ``<end_of_image>\n\n`` (one
    ``<image_soft_token>`` here, expanded to the image's count like any image token, ``neva.data.encoding``)."""

    name = "gemma3"
    eot = "<end_of_turn>"
    assistant_cue = "<start_of_turn>model\n"
    image_block = f"\n\n<start_of_image>{GEMMA3_IMAGE}<end_of_image>\n\n"
    image_token = GEMMA3_IMAGE

    def pieces(self, messages, system):
        out = []
        for i, m in enumerate(messages):
            content = self.image_block.join(part.strip() for part in m.content.split(IMAGE_TOKEN))
            if m.role == USER:
                prefix = f"{system}\n\n" if i == 0 and system else ""
                out.append((f"<start_of_turn>user\n{prefix}{content}<end_of_turn>\n", False))
            else:
                out += [("<start_of_turn>model\n", False), (content, True), ("<end_of_turn>", True), ("\n", False)]
        return out
