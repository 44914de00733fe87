"""``neva.data.preview --tokenizer <HF LLM dir>``: an LLM's own tokenizer has no ``<image>``; the preview adds it as
training does (``model.mm_cfg.llm.from_pretrained``), so its ids are the run's, instead of a traceback."""

from __future__ import annotations

import io
import json

from neva.data.preview import build_parser, preview
from neva.data.tokens import tokenizer_image_token_id
from tests.checkpoint.tiny_hf import make_tokenizer
from tests.data.conftest import qa, write_jsonl


def test_preview_adds_image_token_to_an_hf_llm_tokenizer_as_training_does(tmp_path, capsys):
    from neva.checkpoint.hf_assemble import prepare_tokenizer  # what a from_pretrained run tokenizes with

    llm = tmp_path / "llm"
    make_tokenizer(llm / "_sp", vision_tokens=False).save_pretrained(str(llm))
    data = tmp_path / "d.jsonl"
    write_jsonl(data, [qa(q="<image>\nWhat is it?", a="A red circle.", rid="one", turns=1)])
    args = build_parser().parse_args(
        ["--data-path", str(data), "--conv-template", "vicuna_v1", "--tokenizer", str(llm), "--json",
         "--num-image-tokens", "3"]
    )  # fmt: skip
    out = io.StringIO()
    assert preview(args, out) == 0
    row = json.loads(out.getvalue())
    image_id = tokenizer_image_token_id(prepare_tokenizer(llm))
    assert row["input_ids"].count(image_id) == 3
    err = capsys.readouterr().err
    assert "has no <image> token; added as training adds it" in err and f"(id {image_id})" in err
