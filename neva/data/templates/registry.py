"""Every conversation template by name: the generic formats, then each family's own, found through the family specs
(``TowerSpec.template`` / ``DecoderSpec.template``), so that a family's template is its own file and a spec field."""

from __future__ import annotations

from typing import Any

from neva.constants import IMAGE_TOKEN
from neva.data.templates.base import Template
from neva.data.templates.chat_template import ChatTemplateRenderer
from neva.data.templates.generic import GENERIC
from neva.families import DECODERS, TOWERS, part
from neva.typed import ConfigError

DEFAULT_TEMPLATE = "vicuna_v1"
"""The prompt format when neither the caller nor the checkpoint's ``conv_template`` metadata names one."""
# The generic formats a tokenizer's own chat template replaces when it has one (``use_chat_template``).
_TOKENIZER_RENDERED = ("mistral", "llama_3", "chatml")


def _template_classes() -> dict[str, type[Template]]:
    found: dict[str, type[Template]] = {}
    family_parts = [spec.template for spec in (*TOWERS.values(), *DECODERS.values()) if spec.template]
    for cls in (*GENERIC, *(part(path) for path in family_parts)):
        # Two specs may name one class (Qwen2-VL's and Qwen2.5-VL's towers); two classes may not share a name.
        if found.get(cls.name, cls) is not cls:
            raise TypeError(f"two conversation templates are called {cls.name!r}: {found[cls.name]} and {cls}")
        found[cls.name] = cls
    return found


TEMPLATE_CLASSES: dict[str, type[Template]] = _template_classes()
"""Template name (a run's ``model.data.conv_template``, a checkpoint's ``conv_template``) → its class."""


def get_template(
    name: str, tokenizer: Any = None, use_chat_template: bool = True, system_prompt: str | None = None
) -> Template:
    """The template called ``name``; ``mistral``/``llama_3``/``chatml`` use the tokenizer's chat template if it has one.

    ``system_prompt`` (the run's ``model.data.system_prompt``) is checked against a tokenizer's chat template at once,
    so a template that refuses system prompts stops the run at start instead of skipping every sample.

    Raises:
        ConfigError: unknown template name. ValueError: a system prompt the tokenizer's chat template cannot render.
    """
    if name not in TEMPLATE_CLASSES:
        raise ConfigError(f"unknown conversation template {name!r}; choose one of {sorted(TEMPLATE_CLASSES)}")
    base = TEMPLATE_CLASSES[name]()
    if (
        use_chat_template
        and name in _TOKENIZER_RENDERED
        and tokenizer is not None
        and getattr(tokenizer, "chat_template", None)
    ):
        renderer = ChatTemplateRenderer(tokenizer, base)
        if system_prompt is not None:
            renderer.check_system_prompt(system_prompt)
        return renderer
    return base


def image_token_for(template: str | None) -> str:
    """The image token text of conversation template ``template`` (``<image>`` for a name neva does not know)."""
    cls = TEMPLATE_CLASSES.get(template or "")
    return IMAGE_TOKEN if cls is None else cls.image_token


def raw_image_text(name: str) -> tuple[str, str]:
    """What a raw prompt's ``<image>`` tag becomes for a checkpoint trained with template ``name``: the template's
    image block and the image token text in it, which is repeated to the image's positions — as the family's HF
    processor writes an image (``LlavaProcessor``: ``<image>`` itself; Qwen-VL's and InternVL's their blocks)."""
    block = TEMPLATE_CLASSES[name].image_block if name in TEMPLATE_CLASSES else IMAGE_TOKEN
    return block, image_token_for(name)
