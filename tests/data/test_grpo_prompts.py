"""The online RL stage's prompt records: LLaVA-style and TRL's formats become one conversation (prompt turns, the gold
answer as the reply); the prompt sample is the finetuning encoding cut before the reply's first learned token; bad
records are counted skips with their reason."""

from __future__ import annotations

import json

import pytest

from neva.checkpoint.source import resolve_source
from neva.config import compose_config
from neva.constants import IGNORE_INDEX, IMAGE_TOKEN
from neva.data.dataset import is_skipped, process_record
from neva.data.errors import SampleError
from neva.data.grpo_prompts import prompt_conversation
from neva.training.run import data_module_type


def test_both_formats_give_one_conversation():
    llava = {"id": "a", "image": "x.png", "problem": "How many?", "answer": "3"}
    trl = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}],
           "images": ["x.png"], "solution": "3", "id": "a"}  # fmt: skip
    want = [{"role": "user", "content": f"{IMAGE_TOKEN}\nHow many?"}, {"role": "assistant", "content": "3"}]
    assert prompt_conversation(llava) == {"id": "a", "image": ["x.png"], "conversations": want}
    assert prompt_conversation(trl) == {"id": "a", "image": ["x.png"], "conversations": want}
    tagged = {"problem": f"Look: {IMAGE_TOKEN} how many?", "image": "x.png", "answer": 3}  # the tag kept in place
    assert prompt_conversation(tagged)["conversations"][0]["content"] == f"Look: {IMAGE_TOKEN} how many?"
    assert prompt_conversation({"problem": "2+2?", "answer": "4"})["conversations"][0]["content"] == "2+2?"
    for bad, reason in (({"problem": "q"}, "no_answer"), ({"problem": "q", "answer": " "}, "no_answer"),
                        ({"answer": "3"}, "malformed_prompt"), ({"prompt": 5, "answer": "3"}, "malformed_prompt")):  # fmt: skip
        with pytest.raises(SampleError) as err:
            prompt_conversation(bad)
        assert err.value.reason == reason


def test_prompt_sample_is_the_finetuning_encoding_before_the_reply(tmp_path, tiny_checkpoint):
    records = [{"id": "ok", "problem": "What color is the shape?", "answer": "red"}, {"id": "bad", "problem": "q"}]
    (tmp_path / "p.json").write_text(json.dumps(records))
    cfg = compose_config(["+stage=grpo", f"model.restore_from_path={tiny_checkpoint}",
                          f"model.data.data_path={tmp_path / 'p.json'}", "model.data.synthetic_val_samples=0"])  # fmt: skip
    source = resolve_source(cfg)
    data = data_module_type(cfg)(cfg.model.data, source.tokenizer, source.cfg, micro_batch_size=2)
    data.setup("fit")
    dataset = next(d for d in data.train_datasets if len(d.base.records) == 2)
    by_id = {d["id"]: d for d in (dataset[0], dataset[1])}  # a skip marker carries its id too
    ok, bad = by_id["ok"], by_id["bad"]
    assert is_skipped(bad)
    full = process_record(prompt_conversation(records[0]), dataset.base.settings, dataset.base.image_source,
                          dataset.base.front_end)  # fmt: skip
    first = int((full["labels"] != IGNORE_INDEX).nonzero()[0])
    assert ok["input_ids"].tolist() == full["input_ids"][:first].tolist()
    assert (ok["labels"] == IGNORE_INDEX).all() and ok["record"] == records[0]
    assert source.tokenizer.decode(ok["input_ids"]).rstrip().endswith("ASSISTANT:")  # vicuna_v1's reply header
    batch = data.collator([ok, bad])
    assert len(batch.stage.prompts) == 1 and batch.stage.records == [records[0]]
