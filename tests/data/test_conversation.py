"""Template rendering (exact strings), learned spans and conversation validation."""

from __future__ import annotations

import pytest

from neva.data.conversation import parse_conversations, place_image_tags
from neva.data.templates.base import ConversationError, Message
from neva.data.templates.registry import get_template
from tests.data.llava_reference import get_prompt

U, A = "user", "assistant"
CONV = [Message(U, "<image>\nWhat is it?"), Message(A, "A cat."), Message(U, "Colour?"), Message(A, "Black.")]


def learned_text(rendered):
    return [rendered.text[s:e] for s, e in rendered.learned_spans]


@pytest.mark.parametrize("name", ["vicuna_v1", "llama_2"])
def test_matches_llava_get_prompt(name):
    rendered = get_template(name).render(CONV)
    assert rendered.text == get_prompt(name, [m.content for m in CONV])


def test_plain_matches_llava():
    rendered = get_template("plain").render([Message(U, "Describe it.\n<image>"), Message(A, "a dog")])
    assert rendered.text == get_prompt("plain", ["x", "a dog"]) == "<image>a dog\n"
    assert learned_text(rendered) == ["a dog\n"]


def test_vicuna_spans():
    r = get_template("vicuna_v1").render(CONV)
    assert r.text.endswith(" USER: <image>\nWhat is it? ASSISTANT: A cat.</s>USER: Colour? ASSISTANT: Black.</s>")
    assert learned_text(r) == ["A cat.</s>", "Black.</s>"]


def test_llama_2_spans():
    r = get_template("llama_2").render(CONV)
    assert r.text.startswith("[INST] <<SYS>>\nYou are a helpful")
    assert r.text.endswith("<</SYS>>\n\n<image>\nWhat is it? [/INST] A cat. </s><s>[INST] Colour? [/INST] Black. </s>")
    assert learned_text(r) == ["A cat. </s>", "Black. </s>"]


def test_mistral_llama3_chatml_documented_formats():
    m = get_template("mistral").render(CONV)
    assert m.text == " [INST] <image>\nWhat is it? [/INST] A cat.</s> [INST] Colour? [/INST] Black.</s>"
    assert learned_text(m) == ["A cat.</s>", "Black.</s>"]
    l3 = get_template("llama_3").render(CONV[:2])
    h = "<|start_header_id|>{}<|end_header_id|>\n\n"
    assert l3.text == h.format("user") + "<image>\nWhat is it?<|eot_id|>" + h.format("assistant") + "A cat.<|eot_id|>"
    assert learned_text(l3) == ["A cat.<|eot_id|>"]
    c = get_template("chatml").render([Message("system", "Be brief."), *CONV[:2]])
    assert c.text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<image>\nWhat is it?<|im_end|>\n"
        "<|im_start|>assistant\nA cat.<|im_end|>\n"
    )
    assert learned_text(c) == ["A cat.<|im_end|>"]


def qwen_finetune_labels(ids: list[int], assistant: int, im_end: int) -> list[bool]:
    """Which ids Qwen's qwen-vl-finetune learns (QwenLM/Qwen2.5-VL qwen-vl-finetune/qwenvl/data/data_processor.py,
    preprocess_qwen_visual, rewritten): from two tokens after each ``assistant`` role token through the token after
    the next ``<|im_end|>``."""
    learned, pos = [False] * len(ids), 0
    while pos < len(ids):
        if ids[pos] == assistant:
            end = pos + 2
            while end < len(ids) and ids[end] != im_end:
                end += 1
            if end < len(ids):
                learned[pos + 2 : end + 2] = [True] * len(learned[pos + 2 : end + 2])
                pos = end
        pos += 1
    return learned


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl"])
def test_qwen_vl_learns_what_qwens_finetuning_learns(name):
    """Each reply, its <|im_end|> and the newline after it (issue 52: the newline was not learned)."""
    from neva.data.encoding import encode
    from tests.fixtures.tiny_qwen_vl import qwen_tokenizer

    tok = qwen_tokenizer()
    tok.add_tokens(["assistant"])  # one token, as in Qwen's vocabulary (its "\n" is one already)
    rendered = get_template(name).render([Message("system", "Be brief."), *CONV])
    enc = encode(rendered, tok, tok.convert_tokens_to_ids("<|image_pad|>"), 1, 1)
    want = qwen_finetune_labels(
        enc.input_ids, tok.convert_tokens_to_ids("assistant"), tok.convert_tokens_to_ids("<|im_end|>")
    )
    assert [label != -100 for label in enc.labels] == want
    assert learned_text(rendered) == ["A cat.<|im_end|>\n", "Black.<|im_end|>\n"]


def test_system_turn_overrides_default():
    r = get_template("vicuna_v1").render([Message("system", "SYS."), *CONV[:2]])
    assert r.text.startswith("SYS. USER: ")


def test_generation_prompts():
    assert get_template("vicuna_v1").render_prompt(CONV[:1]).endswith("USER: <image>\nWhat is it? ASSISTANT:")
    assert get_template("llama_2").render_prompt(CONV[:1]).endswith("What is it? [/INST]")
    assert get_template("plain").render_prompt(CONV[:1]) == "<image>"


def test_chat_template_renderer(synthetic_tokenizer):
    import copy

    tok = copy.deepcopy(synthetic_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    t = get_template("chatml", tok)
    r = t.render([Message(U, "What is it?"), Message(A, "  A cat. ")])
    assert not r.add_special_tokens
    assert learned_text(r) == ["A cat.<|im_end|>"]
    assert t.render_prompt([Message(U, "Hi")]).endswith("<|im_start|>assistant\n")


def test_image_placement_front_like_llava():
    msgs = place_image_tags([Message(U, "What is this? <image>"), Message(A, "x")], "front")
    assert msgs[0].content == "<image>\nWhat is this?"
    two = place_image_tags([Message(U, "<image> and <image> differ?")], "front")
    assert two[0].content == "<image>\n<image>\nand  differ?"
    assert place_image_tags([Message(U, "a <image> b")], "inline")[0].content == "a <image> b"


def test_roles_and_errors():
    msgs = parse_conversations(
        [{"from": "system", "value": "s"}, {"from": "user", "value": "q"}, {"from": "assistant", "value": "a"}]
    )
    assert [m.role for m in msgs] == ["system", "user", "assistant"]
    for conv, reason in [
        ([], "empty_conversation"),
        (None, "empty_conversation"),
        ([{"from": "human", "value": "q"}], "empty_conversation"),
        ([{"from": "robot", "value": "q"}, {"from": "gpt", "value": "a"}], "unknown_role"),
        (
            [{"from": "human", "value": "q"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
            "bad_turn_order",
        ),
        ([{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}], "empty_conversation"),  # lead dropped
    ]:
        with pytest.raises(ConversationError) as e:
            parse_conversations(conv)
        assert e.value.reason == reason


def test_unknown_template():
    with pytest.raises(ValueError, match="unknown conversation template"):
        get_template("vicuna_v2")
