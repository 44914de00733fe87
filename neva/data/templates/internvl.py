"""InternVL 3 / 3.5's conversation template (``internvl``; named by its tower spec, ``neva.families.internvl``)."""

from __future__ import annotations

from neva.constants import IMAGE_TOKEN
from neva.data.templates.generic import ChatMLTemplate

INTERNVL_IMAGE_CONTEXT = "<IMG_CONTEXT>"  # InternVL's image token (its tokenizer's ``context_image_token``)


class InternVLTemplate(ChatMLTemplate):
    """InternVL 3 / 3.5's ChatML, as transformers' InternVL chat template renders a conversation of strings (no
    system turn unless one is given) and as ``InternVLProcessor`` expands it: each ``<image>`` tag becomes
    ``<img><IMG_CONTEXT></img>`` in place, the ``<IMG_CONTEXT>`` then expanded to the image's positions (tiles × 256)
    like any image token (``neva.data.encoding``)."""

    name = "internvl"
    image_block = f"<img>{INTERNVL_IMAGE_CONTEXT}</img>"
    image_token = INTERNVL_IMAGE_CONTEXT
    # Not ChatML's body (that one writes <image> as it is): an export ships transformers' InternVL template instead
    # (``neva.checkpoint.hf_internvl``).
    jinja_body = None

    def pieces(self, messages, system):
        return [
            (text.replace(IMAGE_TOKEN, self.image_block), learned) for text, learned in super().pieces(messages, system)
        ]
