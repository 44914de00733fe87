"""The template registry: each family's template is found through its spec, writes images with its HF processor's
image token, and ships a Jinja body (where it has one) that renders as it does (docs/ARCHITECTURE.md, "Adding a
family")."""

from __future__ import annotations

import pytest

from neva.constants import IMAGE_TOKEN
from neva.data.jinja_templates import chat_template_for
from neva.data.templates.base import Message
from neva.data.templates.generic import GENERIC
from neva.data.templates.registry import TEMPLATE_CLASSES, image_token_for, raw_image_text
from neva.families import DECODERS, TOWERS, part

U, A, S = "user", "assistant", "system"
# Each family's image token as its HF processor names it (``image_token`` of Qwen2VLProcessor, Gemma3Processor,
# InternVLProcessor, Glm4vProcessor, PixtralProcessor); every generic template keeps LLaVA's <image>.
PROCESSOR_IMAGE_TOKENS = {
    "qwen2_vl": "<|image_pad|>",
    "qwen3_vl": "<|image_pad|>",
    "gemma3": "<image_soft_token>",
    "internvl": "<IMG_CONTEXT>",
    "glm4v": "<|image|>",
    "mistral3": "[IMG]",
}
CONVERSATIONS = [
    [Message(U, "<image>\nWhat is it?"), Message(A, "A cat."), Message(U, "Colour?"), Message(A, "Black.")],
    [Message(S, "Be brief."), Message(U, "Hi <image> there"), Message(A, "Hello.")],
]


def test_the_registry_is_the_generic_templates_and_those_the_specs_name():
    named = {part(spec.template) for spec in (*TOWERS.values(), *DECODERS.values()) if spec.template}
    assert set(TEMPLATE_CLASSES.values()) == set(GENERIC) | named
    assert all(TEMPLATE_CLASSES[cls.name] is cls for cls in named)


@pytest.mark.parametrize("name", sorted(TEMPLATE_CLASSES))
def test_image_token_is_the_family_processor_s_and_stands_in_its_image_block(name):
    token = PROCESSOR_IMAGE_TOKENS.get(name, IMAGE_TOKEN)
    assert image_token_for(name) == token
    block, raw_token = raw_image_text(name)
    assert raw_token == token and block.count(token) == 1
    rendered = TEMPLATE_CLASSES[name]().render(CONVERSATIONS[0][:2]).text
    assert IMAGE_TOKEN not in rendered or token == IMAGE_TOKEN  # every <image> tag written as the family's block


def test_an_unknown_template_writes_llava_s_image_token():
    assert image_token_for(None) == image_token_for("no_such_template") == IMAGE_TOKEN


@pytest.mark.parametrize("name", sorted(n for n, cls in TEMPLATE_CLASSES.items() if cls.jinja_body is not None))
def test_exported_jinja_body_renders_as_the_template(synthetic_tokenizer, name):
    template = TEMPLATE_CLASSES[name]()
    exported = chat_template_for(name)
    for conv in CONVERSATIONS if name != "plain" else [CONVERSATIONS[0][:2]]:
        msgs = [{"role": m.role, "content": m.content} for m in conv]
        text = synthetic_tokenizer.apply_chat_template(msgs, chat_template=exported, tokenize=False)
        assert text == template.render(conv).text
        prompt = synthetic_tokenizer.apply_chat_template(
            msgs[:-1], chat_template=exported, tokenize=False, add_generation_prompt=True
        )
        assert prompt == template.render_prompt(conv[:-1])


def test_a_template_without_a_jinja_body_is_refused_by_name():
    name = next(n for n, cls in TEMPLATE_CLASSES.items() if cls.jinja_body is None)
    with pytest.raises(ValueError, match=f"template {name!r} has no Jinja body"):
        chat_template_for(name)
