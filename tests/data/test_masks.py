"""Masks exact by construction: whole-string tokenization, labels from offsets, image expansion, truncation."""

from __future__ import annotations

import io
import json

import pytest

from neva.constants import IGNORE_INDEX
from neva.data.encoding import EncodingError, encode
from neva.data.preview import build_parser, preview
from neva.data.templates.base import Message
from neva.data.templates.registry import get_template
from tests.data.conftest import qa, write_jsonl
from tests.data.llava_reference import drop_leading_reply, get_prompt

CONVS = [
    qa(q="<image>\nWhat is in the image?", a="A red circle.", rid="one", turns=1),
    qa(q="Describe this <image>", a="no", rid="multi", turns=3),
    qa(image=None, q="How many shapes are there?", a="yes", rid="text", turns=2),
    # LLaVA drops a leading gpt turn and trains on the rest
    {**qa(rid="lead", turns=2), "conversations": [{"from": "gpt", "value": "Hi!"}, *qa(turns=2)["conversations"]]},
]


def expected(tokenizer, template: str, record: dict, n_img: int):
    """Oracle: LLaVA's rendering tokenized whole; labels by brute-force character overlap."""
    values = [t["value"] for t in drop_leading_reply(record["conversations"])]
    text = get_prompt(template, values)
    enc = tokenizer(text, return_offsets_mapping=True)
    # learned characters = replies + the template's end-of-turn text, located independently of our renderer
    eot = {"plain": "\n", "vicuna_v1": "</s>", "llama_2": " </s>"}[template]
    learned = set()
    cursor = 0
    for reply in values[1::2]:
        start = text.index(reply + eot, cursor)
        learned.update(range(start, start + len(reply) + len(eot)))
        cursor = start + len(reply)
    img = tokenizer.convert_tokens_to_ids("<image>")
    ids, labels = [], []
    for tid, (s, e) in zip(enc["input_ids"], enc["offset_mapping"]):
        if tid == img:
            ids += [img] * n_img
            labels += [IGNORE_INDEX] * n_img
            continue
        ids.append(tid)
        labels.append(tid if any(c in learned for c in range(s, e)) else IGNORE_INDEX)
    return ids, labels


@pytest.mark.parametrize("template", ["plain", "vicuna_v1", "llama_2"])
def test_preview_json_equals_llava_whole_string_tokenization(tmp_path, llama_tokenizer_dir, llama_tokenizer, template):
    records = CONVS[:1] if template == "plain" else CONVS
    path = tmp_path / "d.jsonl"
    write_jsonl(path, records)
    args = build_parser().parse_args(
        ["--data-path", str(path), "--conv-template", template, "--tokenizer", llama_tokenizer_dir, "--json",
         "--num-image-tokens", "3"]
    )  # fmt: skip
    out = io.StringIO()
    assert preview(args, out) == 0
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["id"] for r in rows] == [r["id"] for r in records]
    for row, record in zip(rows, records):
        n_img = 3 if "image" in record else 0
        ids, labels = expected(llama_tokenizer, template, record, n_img)
        assert row["input_ids"] == ids
        assert row["labels"] == labels
        assert any(label != IGNORE_INDEX for label in labels)


def test_multi_turn_vicuna_is_not_a_mismatch(llama_tokenizer):
    """The case LLaVA's preprocess_v1 drops with a non-legacy tokenizer: every reply and </s> is learned."""
    conv = [
        Message("user", "<image>\nQ1"),
        Message("assistant", "yes"),
        Message("user", "Q2"),
        Message("assistant", "no"),
    ]
    enc = encode(
        get_template("vicuna_v1").render(conv), llama_tokenizer, llama_tokenizer.convert_tokens_to_ids("<image>"), 4, 1
    )
    learned = [i for i, label in zip(enc.input_ids, enc.labels) if label != IGNORE_INDEX]
    text = llama_tokenizer.decode(learned)
    assert text.replace(" ", "") == "yes</s>no</s>"
    assert enc.labels.count(IGNORE_INDEX) < len(enc.labels)
    eos = llama_tokenizer.eos_token_id
    assert learned.count(eos) == 2


def test_labels_aligned_and_unlearned_positions(synthetic_tokenizer):
    tok = synthetic_tokenizer
    conv = [Message("user", "<image>\nWhat color is the shape?"), Message("assistant", "red")]
    enc = encode(get_template("vicuna_v1").render(conv), tok, 4, 16, 1)
    assert len(enc.input_ids) == len(enc.labels)
    assert enc.labels[0] == IGNORE_INDEX  # BOS
    assert enc.input_ids.count(4) == 16 and all(
        enc.labels[i] == IGNORE_INDEX for i, t in enumerate(enc.input_ids) if t == 4
    )
    for tid, label in zip(enc.input_ids, enc.labels):
        assert label in (IGNORE_INDEX, tid)
    assert tok.convert_ids_to_tokens([t for t in enc.labels if t != IGNORE_INDEX]) == ["Ġred", "</s>"]


def test_truncation_never_splits_images(synthetic_tokenizer):
    tok, tmpl = synthetic_tokenizer, get_template("vicuna_v1")
    conv = [Message("user", "<image>\nWhat color is the shape?"), Message("assistant", "red")]
    full = encode(tmpl.render(conv), tok, 4, 16, 1)
    with pytest.raises(EncodingError) as e:  # the image span ends past the limit
        encode(tmpl.render(conv), tok, 4, 16, 1, max_length=full.input_ids.index(4) + 10)
    assert e.value.reason == "too_long"
    with pytest.raises(EncodingError) as e:  # image fits, the reply does not: nothing left to learn
        encode(tmpl.render(conv), tok, 4, 16, 1, max_length=len(full.input_ids) - 3)
    assert e.value.reason == "no_learned_tokens"
    cut = encode(tmpl.render(conv), tok, 4, 16, 1, max_length=len(full.input_ids) - 1)  # keeps "red", drops </s>
    assert cut.input_ids == full.input_ids[:-1] and cut.labels == full.labels[:-1]
    assert cut.truncated_from == len(full.input_ids) and full.truncated_from is None  # the cut is recorded


def test_image_tag_must_be_special(synthetic_tokenizer):
    conv = [Message("user", "<image>\nQ"), Message("assistant", "a")]
    with pytest.raises(EncodingError) as e:
        encode(get_template("vicuna_v1").render(conv), synthetic_tokenizer, 4, 2, num_images=2)
    assert e.value.reason == "image_count_mismatch"


def test_preview_text_mode(tmp_path, synthetic_tokenizer):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, [CONVS[2], {"id": "bad", "conversations": []}])
    out = io.StringIO()
    args = build_parser().parse_args(["--data-path", str(path), "--conv-template", "vicuna_v1", "--tokenizer",
                                      "synthetic", "--num-image-tokens", "4", "--no-color"])  # fmt: skip
    assert preview(args, out) == 1
    text = out.getvalue()
    assert "⟦yes</s>⟧" in text and "SKIPPED (empty_conversation" in text
