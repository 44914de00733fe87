"""``model.data.tokenization=llava``: LLaVA's trainer's ids (``tokenizer_image_token``) and labels (``preprocess_*``),
both transcribed in ``tests/data/llava_reference.py``; labels stay exact character overlaps (the separator space
before a reply joins the learned text, nothing else); ``neva.generate`` builds the same ids for a checkpoint trained
so. The real LLaVA trainer is the oracle of ``tests/training/test_llava_trainer.py``."""

from __future__ import annotations

import pytest

from neva.constants import IGNORE_INDEX
from neva.data.conversation import read_conversation
from neva.data.encoding import encode, tokenize_text
from neva.data.templates.registry import get_template
from neva.inference import PromptBuilder
from neva.models.config import NevaConfig
from tests.data.conftest import qa
from tests.data.llava_reference import IMAGE_TOKEN_INDEX, get_prompt, llava_labels, tokenizer_image_token

N_IMG = 3
RECORDS = [
    qa(q="<image>\nWhat is in the image?", a="A red circle.", rid="one", turns=1),
    qa(q="<image>\nHow many shapes are there?", a="2 shapes", rid="digit", turns=3),  # " 2": a lone ▁ in LLaVA
    qa(image=None, q="How many shapes are there?", a="yes", rid="text", turns=2),
]


def collapse(ids: list[int], labels: list[int], image_id: int) -> tuple[list[int], list[int]]:
    out = [(IMAGE_TOKEN_INDEX if t == image_id else t, lab) for i, (t, lab) in enumerate(zip(ids, labels))
           if not (t == image_id and i and ids[i - 1] == image_id)]  # fmt: skip
    return [t for t, _ in out], [lab for _, lab in out]


@pytest.mark.parametrize("template", ["plain", "vicuna_v1", "llama_2"])
def test_llava_ids_and_labels_equal_llava_trainer(llama_tokenizer, template):
    image_id = llama_tokenizer.convert_tokens_to_ids("<image>")
    for record in RECORDS[:1] if template == "plain" else RECORDS:
        messages, _ = read_conversation(record["conversations"])
        rendered = get_template(template).render(messages)
        values = [t["value"] for t in record["conversations"]]
        has_image = "image" in record
        prompt = get_prompt(template, values)
        assert rendered.text == prompt
        enc = encode(rendered, llama_tokenizer, image_id, N_IMG, int(has_image), tokenization="llava")
        ids, labels = collapse(enc.input_ids, enc.labels, image_id)
        assert ids == (tokenizer_image_token(prompt, llama_tokenizer) if has_image else
                       llama_tokenizer(prompt).input_ids), record["id"]  # fmt: skip
        assert labels == llava_labels(template, prompt, values, llama_tokenizer, has_image), record["id"]


def test_llava_labels_are_exact_character_overlaps(llama_tokenizer):
    """Every learned token overlaps a reply, its end of turn or the one space before the reply; every reply
    character is in a learned token (both conventions)."""
    image_id = llama_tokenizer.convert_tokens_to_ids("<image>")
    messages, _ = read_conversation(RECORDS[1]["conversations"])
    rendered = get_template("vicuna_v1").render(messages)
    text = rendered.text
    for tokenization, widen in (("neva", 0), ("llava", 1)):
        ids, offsets = tokenize_text(text, llama_tokenizer, True, image_id, tokenization)
        enc = encode(rendered, llama_tokenizer, image_id, 1, 1, tokenization=tokenization)
        assert len(enc.input_ids) == len(ids) and [t for t in enc.input_ids] == ids  # one position per image here
        allowed = set()
        for start, end in rendered.learned_spans:
            assert text[start - 1] == " "  # the separator after "ASSISTANT:"
            allowed.update(range(start - widen, end))
        covered = set()
        for tid, label, (s, e) in zip(ids, enc.labels, offsets):
            if label != IGNORE_INDEX:
                assert label == tid and set(range(s, e)) & allowed, (tokenization, s, e)
                covered.update(range(s, e))
            else:
                assert not set(range(s, e)) & allowed, (tokenization, s, e, text[s:e])
        assert {c for span in rendered.learned_spans for c in range(*span)} <= covered
        assert text[slice(*rendered.learned_spans[0])] == "2 shapes</s>"


def test_generate_builds_the_trained_ids(llama_tokenizer):
    """PromptBuilder with a checkpoint's ``tokenization``: the prompt tokenized as training tokenized its text."""
    image_id = llama_tokenizer.convert_tokens_to_ids("<image>")
    cfg = NevaConfig(image_token_id=image_id)
    cfg.llm.vocab_size = len(llama_tokenizer)
    per_image = cfg.num_image_tokens
    template = get_template("vicuna_v1")
    text = template.render_prompt(read_conversation(RECORDS[0]["conversations"])[0][:1])
    for tokenization in ("neva", "llava"):
        built = PromptBuilder(llama_tokenizer, cfg, "vicuna_v1", tokenization=tokenization).ids(
            "What is in the image?", 1
        )
        ids, _ = tokenize_text(text, llama_tokenizer, True, image_id, tokenization)
        assert built == [t for i in ids for t in ([i] * per_image if i == image_id else [i])]
    llava = PromptBuilder(llama_tokenizer, cfg, "vicuna_v1", tokenization="llava").ids("What is in the image?", 1)
    neva = PromptBuilder(llama_tokenizer, cfg, "vicuna_v1").ids("What is in the image?", 1)
    assert len(llava) == len(neva) + 1  # the dummy-prefix piece after the image
    assert collapse(llava, llava, image_id)[0] == tokenizer_image_token(text, llama_tokenizer)
