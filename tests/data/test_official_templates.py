"""Built-in templates against the official chat templates (``official_templates``), and the template habits neva
guards against: a system prompt dropped (Mistral v0.3) or refused (original Mistral), no final end of turn (vLLM
ChatML)."""

from __future__ import annotations

import copy
import warnings

import pytest

from neva.data.dataset import EncoderSettings, process_record
from neva.data.front_ends import NoImages
from neva.data.jinja_templates import chat_template_for
from neva.data.templates.base import ConversationError, Message
from neva.data.templates.generic import VICUNA_SYSTEM
from neva.data.templates.registry import get_template
from tests.data import official_templates as official

U, A, S = "user", "assistant", "system"
CONV = [
    Message(U, "<image>\nWhat colour is the circle?"),
    Message(A, "Red."),
    Message(U, "And the square?"),
    Message(A, "Blue."),
]
UNTRIMMED = [Message(U, " <image>\nWhat colour? \n"), Message(A, "\n\n A red circle.\n")]


def learned(rendered):
    return [rendered.text[s:e] for s, e in rendered.learned_spans]


def render_official(tok, template: str, messages, **kw) -> str:
    msgs = [{"role": m.role, "content": m.content} for m in messages]
    return tok.apply_chat_template(msgs, chat_template=template, tokenize=False, **kw)


def with_template(tok, template: str):
    tok = copy.deepcopy(tok)
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("system", [None, "Answer in one word."])
def test_mistral_builtin_equals_official(llama_tokenizer, system):
    conv = CONV if system is None else [Message(S, system), *CONV]
    ref = render_official(llama_tokenizer, official.MISTRAL_V01, conv)
    text = get_template("mistral").render(conv).text
    assert ref == "<s>" + text  # BOS: the official template writes it, neva's tokenizer call adds it
    assert "[/INST] Red.</s> [INST]" in text
    ids = llama_tokenizer(text).input_ids
    assert ids == llama_tokenizer(ref, add_special_tokens=False).input_ids
    reply = ids[len(llama_tokenizer(text[: text.index("Red.")].rstrip()).input_ids)]
    assert llama_tokenizer.convert_ids_to_tokens(reply).startswith("▁")  # ▁Red, the word-initial piece


def test_llama_3_builtin_trims_as_meta(llama_tokenizer):
    for conv in (UNTRIMMED, [Message(S, " Be brief. "), *UNTRIMMED]):
        ref = render_official(llama_tokenizer, official.LLAMA_3, conv)
        rendered = get_template("llama_3").render(conv)
        assert ref == "<s>" + rendered.text
        assert learned(rendered) == ["A red circle.<|eot_id|>"]
        prompt = render_official(llama_tokenizer, official.LLAMA_3, conv[:-1], add_generation_prompt=True)
        assert prompt == "<s>" + get_template("llama_3").render_prompt(conv[:-1])


def test_llama_2_builtin_equals_official_but_for_llava_default_system(llama_tokenizer):
    t = get_template("llama_2")
    assert render_official(llama_tokenizer, official.LLAMA_2, CONV) == "<s>" + t.render(CONV, system_prompt="").text
    conv = [Message(S, "Be brief."), *CONV]
    assert render_official(llama_tokenizer, official.LLAMA_2, conv) == "<s>" + t.render(conv).text
    assert t.default_system and t.default_system in t.render(CONV).text  # LLaVA's, documented in docs/DATA.md


def test_chatml_builtin_equals_qwen_with_its_default_system(llama_tokenizer):
    qwen_default = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    ref = render_official(llama_tokenizer, official.QWEN2_5, CONV)
    assert ref == get_template("chatml").render(CONV, system_prompt=qwen_default).text
    assert get_template("chatml").render(CONV).text == ref.replace(
        f"<|im_start|>system\n{qwen_default}<|im_end|>\n", ""
    )


def test_vicuna_prompt_matches_llava_hf_turns(llama_tokenizer):
    parts = [{"role": U, "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    hf = llama_tokenizer.apply_chat_template(
        parts, chat_template=official.LLAVA_1_5_HF, tokenize=False, add_generation_prompt=True
    )
    ours = llama_tokenizer.apply_chat_template(
        parts, chat_template=chat_template_for("vicuna_v1"), tokenize=False, add_generation_prompt=True
    )
    # llava-hf writes no system prompt and a space after each turn; LLaVA-1.5 trained with both (vicuna_v1).
    assert hf == "USER: <image>\nWhat is it? ASSISTANT:"
    assert ours == f"{VICUNA_SYSTEM} USER: <image>\nWhat is it? ASSISTANT:"


def test_vllm_chatml_without_final_end_of_turn_warns(llama_tokenizer):
    tok = with_template(llama_tokenizer, official.VLLM_CHATML)
    with pytest.warns(UserWarning, match="does not write '<\\|im_end\\|>' after the final reply"):
        t = get_template("chatml", tok)
    assert learned(t.render(CONV[:2])) == ["Red."]  # what the warning is about: no end of turn learned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_template("chatml", with_template(llama_tokenizer, official.QWEN2_5))


def test_mistral_v03_system_prompt_is_trained_where_served(llama_tokenizer):
    tok = with_template(llama_tokenizer, official.MISTRAL_V03)
    system = "Answer in one word."
    # The official rendering of a whole conversation drops the system prompt...
    assert system not in render_official(tok, official.MISTRAL_V03, [Message(S, system), *CONV])
    t = get_template("mistral", tok, system_prompt=system)
    rendered = t.render(CONV, system_prompt=system)
    # ...neva trains the final reply in its served context (system prompt on the last user turn), then the reply.
    served = t.render_prompt(CONV[:-1], system_prompt=system)
    assert system in served
    assert rendered.text == served + " Blue.</s>"
    assert learned(rendered) == ["Red.</s>", "Blue.</s>"]
    assert not rendered.add_special_tokens


def test_original_mistral_template_refuses_system_prompt_at_start_or_skips(llama_tokenizer):
    tok = with_template(llama_tokenizer, official.MISTRAL_V01_ORIGINAL)
    with pytest.raises(ValueError, match=r"model\.data\.system_prompt is set .* model\.data\.use_chat_template=false"):
        get_template("mistral", tok, system_prompt="Be brief.")
    t = get_template("mistral", tok)
    with pytest.raises(ConversationError) as err:
        t.render([Message(S, "Be brief."), *CONV])
    assert err.value.reason == "template_error"
    settings = EncoderSettings(tok, t, image_token_id=tok.convert_tokens_to_ids("<image>"), num_image_tokens=1,
                               max_length=None)  # fmt: skip
    record = {"id": 7, "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                         {"from": "gpt", "value": "Hello"}]}  # fmt: skip
    assert process_record(record, settings, None, NoImages()) == {
        "id": 7,
        "skipped": "template_error",
        "detail": "mistral chat template: Conversation roles must alternate user/assistant/user/assistant/...",
    }
    assert "skipped" not in process_record(
        {"id": 8, "conversations": record["conversations"][1:]}, settings, None, NoImages()
    )


def test_llama_3_1_tokenizer_template_renders_its_system_header(llama_tokenizer):
    tok = with_template(llama_tokenizer, official.LLAMA_3_1)
    rendered = get_template("llama_3", tok).render(UNTRIMMED)
    assert rendered.text == render_official(tok, official.LLAMA_3_1, UNTRIMMED)
    assert "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>" in rendered.text
    assert learned(rendered) == ["A red circle.<|eot_id|>"]
    # the exported template is the tokenizer's own, so serving renders the same header
    exported = chat_template_for("llama_3", tok)
    assert render_official(tok, exported, UNTRIMMED) == rendered.text
