"""Mistral 3's conversation template (``mistral3``; named by the Pixtral tower's spec, ``neva.families.pixtral``)."""

from __future__ import annotations

from neva.constants import IMAGE_TOKEN
from neva.data.templates.base import USER, Template

# Mistral 3's image text tokens (PixtralProcessor's): one [IMG] per merged token, [IMG_BREAK] after each row, the
# last one [IMG_END].
PIXTRAL_IMAGE, PIXTRAL_BREAK, PIXTRAL_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"


class Mistral3Template(Template):
    """Mistral 3's chat format (Mistral Small 3.1's ``chat_template``; mistral-common's Tekken instruct format, no spaces
    around ``[INST]`` / ``[/INST]``): ``[SYSTEM_PROMPT]{s}[/SYSTEM_PROMPT]`` where a system prompt is given,
    ``[INST]{q}[/INST]{a}</s>`` per exchange, BOS from the tokenizer. An ``<image>`` tag is
    ``[IMG]`` in place (the template's image part), which ``PixtralProcessor`` expands to the image's rows of
    ``[IMG]`` with their ``[IMG_BREAK]`` / ``[IMG_END]`` (``neva.data.pixtral_images``)."""

    name = "mistral3"
    eot = "</s>"
    image_block = PIXTRAL_IMAGE
    image_token = PIXTRAL_IMAGE

    def pieces(self, messages, system):
        out = [(f"[SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT]", False)] if system else []
        for m in messages:
            content = m.content.replace(IMAGE_TOKEN, self.image_block)
            if m.role == USER:
                out.append((f"[INST]{content}[/INST]", False))
            else:
                out += [(content, True), ("</s>", True)]
        return out
