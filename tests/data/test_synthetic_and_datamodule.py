"""Synthetic set and tokenizer; the data module end to end: workers, skip counts, exact resume."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch

from neva.data.config import DataConfig
from neva.data.datamodule import NevaDataModule
from neva.data.synthetic import (
    COLORS,
    SHAPES,
    SyntheticImages,
    make_record,
    synthetic_eval_records,
    synthetic_records,
)
from neva.models.presets import build_config


def tiny_cfg(tokenizer):
    return build_config(image_token_id=tokenizer.convert_tokens_to_ids("<image>"))


def test_synthetic_is_deterministic_and_split():
    assert make_record(0, "train", 7, "qa") == make_record(0, "train", 7, "qa")
    imgs = SyntheticImages(0, 32)
    a, b = np.asarray(imgs("train/000007.png")), np.asarray(imgs("train/000007.png"))
    assert a.shape == (32, 32, 3) and (a == b).all()
    assert not (np.asarray(imgs("val/000007.png")) == a).all()
    qa = synthetic_records(0, "train", 50, "qa")
    answers = {t["value"] for r in qa for t in r["conversations"][1::2]}
    assert set(COLORS) <= answers and set(SHAPES) <= answers and {"one", "two", "three", "top left"} <= answers
    assert all(len(a.split()) <= 2 for a in answers)
    caps = synthetic_records(0, "train", 5, "caption")
    assert all(len(r["conversations"]) == 2 for r in caps)
    evals = synthetic_eval_records(32, num_samples=12)
    assert {e.kind for e in evals} == {"color", "shape", "count", "position"}
    assert evals[0].image.size == (32, 32) and evals[0].answer


def test_tokenizer_properties_and_determinism(synthetic_tokenizer, tmp_path):
    tok = synthetic_tokenizer
    assert len(tok) < 512
    assert [tok.convert_tokens_to_ids(t) for t in ("<unk>", "<s>", "</s>", "<pad>", "<image>")] == [0, 1, 2, 3, 4]
    text = "ünïcode ☃ [INST] <image> x</s>"
    ids = tok(text)["input_ids"]
    assert ids[0] == 1 and 4 in ids and tok.decode(ids[1:], skip_special_tokens=False) == text
    for word in [*COLORS, *SHAPES, "one", "two", "three"]:
        assert len(tok(" " + word, add_special_tokens=False)["input_ids"]) == 1, word
    code = "from neva.data.synthetic import build_tokenizer as b; print(b()('two red circles <image>')['input_ids'])"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str(tok("two red circles <image>")["input_ids"])
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path)("a <image>")["input_ids"] == tok("a <image>")["input_ids"]


def test_datamodule_batches_and_workers(synthetic_tokenizer):
    cfg = tiny_cfg(synthetic_tokenizer)
    dm = NevaDataModule(
        DataConfig(synthetic_train_samples=24, num_workers=2), synthetic_tokenizer, cfg, micro_batch_size=4
    )
    batches = list(dm.train_dataloader())
    assert len(batches) == 6
    b = batches[0]
    assert b.input_ids.shape[0] == 4 and b.input_ids.shape[1] % 64 == 0
    image = b.media.image
    assert image.pixels.shape == (4, 3, 32, 32) and image.items_per_row.tolist() == [1, 1, 1, 1]
    assert ((b.input_ids == cfg.image_token_id).sum(1) == cfg.num_image_tokens).all()
    assert dm.skip_tracker.used == 24
    val = list(dm.val_dataloader())
    assert len(val) == 200 // 4 and val[0].counts.ids[0] == "synthetic-val-0"


def test_datamodule_resume_exact_next_sample(synthetic_tokenizer):
    cfg = tiny_cfg(synthetic_tokenizer)
    data = DataConfig(synthetic_train_samples=40, packing=True)
    ref = [
        b.counts.ids
        for b in NevaDataModule(data, synthetic_tokenizer, cfg, micro_batch_size=2, dp_world=2).train_dataloader()
    ]
    dm = NevaDataModule(data, synthetic_tokenizer, cfg, micro_batch_size=2, dp_world=2)
    it = iter(dm.train_dataloader())
    for _ in range(3):
        next(it)
    state = dm.state_dict()
    assert state["sampler"]["consumed_samples"] == 12
    dm2 = NevaDataModule(data, synthetic_tokenizer, cfg, micro_batch_size=2, dp_world=2)
    dm2.load_state_dict(state)  # before the loader exists, as Lightning does on restore
    rest = [b.counts.ids for b in dm2.train_dataloader()]
    assert rest == ref[3:]
    rank1 = NevaDataModule(data, synthetic_tokenizer, cfg, micro_batch_size=2, dp_rank=1, dp_world=2)
    assert not set(next(iter(rank1.train_dataloader())).counts.ids) & set(ref[0])


def test_text_only_and_blend(tmp_path, synthetic_tokenizer):
    import json

    path = tmp_path / "text.json"
    recs = [
        {"id": f"t{i}", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yes"}]}
        for i in range(5)
    ]
    path.write_text(json.dumps(recs))
    data = DataConfig(
        data_path=["synthetic", str(path)], concat_sampling_probabilities=[0.5, 0.5], synthetic_train_samples=20
    )
    dm = NevaDataModule(data, synthetic_tokenizer, tiny_cfg(synthetic_tokenizer), micro_batch_size=5)
    ids = [i for b in dm.train_dataloader() for i in b.counts.ids]
    assert sum(i.startswith("t") for i in ids) == 12  # 5 records upsampled to ~half of 25 draws (ties: first set)
    text_batch = next(b for b in dm.train_dataloader() if _images(b) < 5)
    image = text_batch.media.image
    assert image is None or image.pixels.shape[0] == int(image.items_per_row.sum())
    assert torch.is_tensor(text_batch.labels)


def _images(batch) -> int:
    image = batch.media.image
    return 0 if image is None else int(image.items_per_row.sum())
