"""Streaming ``.tar`` shards: same samples as JSON, bad members skipped and counted, exact resume, rank partition."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch
import webdataset

from neva.data import shards as shards_mod
from neva.data.config import DataConfig
from neva.data.datamodule import NevaDataModule
from neva.data.dataset import ConversationDataset, EncoderSettings
from neva.data.front_ends import FixedImages
from neva.data.images import ImageProcessor, image_source_for
from neva.data.make_shards import main as make_shards_main
from neva.data.records import load_records
from neva.data.shards import ShardDataset, count_samples, index_path
from neva.data.skips import DataQualityError
from neva.data.templates.registry import get_template
from tests.data.conftest import qa, write_image, write_jsonl

N_RECORDS = 16
PER_SHARD = 4


def _records() -> list[dict]:
    recs = []
    for i in range(N_RECORDS):
        if i % 5 == 3:
            recs.append(qa(image=None, q="Tell me.", a=f"Answer {i}.", rid=f"r{i}"))  # text-only
        elif i % 5 == 4:
            recs.append(qa(image=[f"img/{i}a.png", f"img/{i}b.jpg"], q="<image>\n<image>\nSame?", rid=f"r{i}"))
        else:
            recs.append(qa(image=f"img/{i}.png", a=f"Shape {i}.", rid=f"r{i}", turns=1 + i % 3))
    return recs


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory):
    """A JSONL file + image folder, and the same records written as 4 shards by the CLI."""
    d = tmp_path_factory.mktemp("shards")
    folder = d / "images"
    for i, rec in enumerate(_records()):
        names = rec.get("image", [])
        for j, name in enumerate([names] if isinstance(names, str) else names):
            fmt = "JPEG" if name.endswith(".jpg") else "PNG"
            write_image(folder / name, size=(30 + i, 24 + 2 * j), seed=i * 10 + j, fmt=fmt)
    path = d / "data.jsonl"
    write_jsonl(path, _records())
    assert make_shards_main(
        ["--data-path", str(path), "--image-folder", str(folder), "--out", str(d / "out" / "llava"),
         "--samples-per-shard", str(PER_SHARD)]
    ) == 0  # fmt: skip
    return str(path), str(folder), str(d / "out" / "llava-{000000..000003}.tar")


def _settings(tokenizer, vision):
    return EncoderSettings(tokenizer, get_template("vicuna_v1"), 4, vision.num_image_tokens, 256)


def _dm(tokenizer, vision, data_path, mbs=2, dp_rank=0, dp_world=2, **kw):
    cfg = DataConfig(data_path=data_path, seq_length=256, **kw)
    return NevaDataModule(cfg, tokenizer, vision=vision, micro_batch_size=mbs, dp_rank=dp_rank, dp_world=dp_world)


def test_shards_give_the_json_samples(shard_set, synthetic_tokenizer, vision):
    path, folder, pattern = shard_set
    assert all(os.path.exists(index_path(s)) for s in shards_mod.expand_shard_spec(pattern))
    settings = _settings(synthetic_tokenizer, vision)
    ref = ConversationDataset(
        load_records(path), settings, image_source_for(folder), FixedImages(ImageProcessor(vision))
    )
    ds = ShardDataset.from_spec(pattern, settings, FixedImages(ImageProcessor(vision)))
    assert ds.counts == [PER_SHARD] * 4 and len(ds) == len(ref) == N_RECORDS
    for i in range(N_RECORDS):
        a, b = ref[i], ds[i]
        assert "skipped" not in a and a["id"] == b["id"] == f"r{i}"
        for k in ("input_ids", "labels", "pixel_values"):
            assert torch.equal(a[k], b[k]), (i, k)
    assert ds[4]["pixel_values"].shape[0] == 2 and ds[3]["pixel_values"].shape[0] == 0


def _member(key: str, suffix: str, data: bytes) -> tuple[str, bytes]:
    return f"{key}.{suffix}", data


def _png_bytes(seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_bad_members_are_skipped_and_counted(tmp_path, synthetic_tokenizer, vision):
    good = [{"__key__": f"g{i}", "json": json.dumps(qa(image=f"g{i}.png", rid=f"good{i}")).encode(),
             "png": _png_bytes(i)} for i in range(4)]  # fmt: skip
    bad = [
        {"__key__": "m", "json": json.dumps(qa(image="m.png", rid="missing")).encode()},  # no image member
        {"__key__": "c", "json": json.dumps(qa(image="c.png", rid="corrupt")).encode(), "png": b"\x89PNG garbage"},
        {"__key__": "j", "json": b'{"id": "broken", "conversations": [', "png": _png_bytes(9)},
        {"__key__": "u", "json": b'{"id": "\xe9"}'},
        {"__key__": "n", "png": _png_bytes(8)},  # no json member at all
        {"__key__": "o", "json": json.dumps(qa(image="g0.png", rid="other")).encode()},  # names another sample's image
    ]
    shard = str(tmp_path / "bad.tar")
    with webdataset.TarWriter(shard, encoder=False) as w:
        for s in [good[0], good[1], *bad, good[2], good[3]]:
            w.write(s)
    assert count_samples(shard) == 10  # no index: counted from the headers
    ds = ShardDataset.from_spec(shard, _settings(synthetic_tokenizer, vision), FixedImages(ImageProcessor(vision)))
    reasons = {s["id"]: s.get("skipped") for s in (ds[i] for i in range(len(ds)))}
    assert reasons == {
        "good0": None, "good1": None, "good2": None, "good3": None,
        "missing": "missing_image", "corrupt": "corrupt_image", "bad.tar:j": "malformed_json",
        "bad.tar:u": "invalid_utf8", "bad.tar:n": "malformed_json", "other": "missing_image",
    }  # fmt: skip

    dm = _dm(synthetic_tokenizer, vision, shard, mbs=5, dp_world=1, max_skip_fraction=1.0)
    batches = list(dm.train_dataloader())
    assert sum(b.counts.num_samples for b in batches) == 4 and dm.skip_tracker.used == 4
    assert dm.skip_tracker.skipped == {
        "missing_image": 2, "corrupt_image": 1, "malformed_json": 2, "invalid_utf8": 1,
    }  # fmt: skip
    strict = _dm(synthetic_tokenizer, vision, shard, mbs=5, dp_world=1, skip_check_min_samples=5)
    with pytest.raises(DataQualityError, match="max_skip_fraction"):
        for _ in strict.train_dataloader():
            pass


def _ids_and_tokens(batch) -> list:
    return [batch.counts.ids, batch.input_ids.tolist(), batch.labels.tolist()]


@pytest.mark.parametrize("buffer", [0, 3])
def test_resume_continues_with_the_same_micro_batches(shard_set, synthetic_tokenizer, vision, monkeypatch, buffer):
    _, _, pattern = shard_set
    ref_loader = _dm(synthetic_tokenizer, vision, pattern, shard_shuffle_buffer=buffer).train_dataloader()
    ref = [_ids_and_tokens(b) for b in ref_loader]
    assert len(ref) == N_RECORDS // 4
    dm = _dm(synthetic_tokenizer, vision, pattern, shard_shuffle_buffer=buffer)
    it = iter(dm.train_dataloader())
    for _ in range(2):
        next(it)
    state = dm.state_dict()
    assert state["sampler"]["consumed_samples"] == 8

    opened = []
    real_open = shards_mod.open_shard
    monkeypatch.setattr(shards_mod, "open_shard", lambda p: (opened.append(p), real_open(p))[1])
    dm2 = _dm(synthetic_tokenizer, vision, pattern, shard_shuffle_buffer=buffer)
    dm2.load_state_dict(state)  # before the loader exists, as Lightning does on restore
    loader = dm2.train_dataloader()
    rest = [_ids_and_tokens(b) for b in loader]
    assert rest == ref[2:]
    # One global batch = one shard here: the two finished shards are never opened again.
    order = dm2.train_sampler.order(0)
    ds = dm2.train_datasets[0]
    later = {ds.shards[ds.locate(int(i))[0]] for i in order[8:]}
    assert set(opened) == later and len(later) == 2

    # An uninterrupted run and a resumed one also agree on the next epoch (new shard order).
    ref_next = [_ids_and_tokens(b) for b in ref_loader]
    assert [_ids_and_tokens(b) for b in loader] == ref_next
    assert [r[0] for r in ref_next] != [r[0] for r in ref]


def test_two_ranks_cover_each_global_batch_once(shard_set, synthetic_tokenizer, vision):
    _, _, pattern = shard_set
    ranks = [list(_dm(synthetic_tokenizer, vision, pattern, dp_rank=r).train_dataloader()) for r in range(2)]
    single = list(_dm(synthetic_tokenizer, vision, pattern, mbs=4, dp_world=1).train_dataloader())
    assert len(ranks[0]) == len(ranks[1]) == len(single) == N_RECORDS // 4
    for b0, b1, whole in zip(ranks[0], ranks[1], single):
        assert not set(b0.counts.ids) & set(b1.counts.ids)
        assert b0.counts.ids + b1.counts.ids == whole.counts.ids  # rank r = r-th micro-batch of the global batch
    assert sorted(i for b in single for i in b.counts.ids) == sorted(f"r{i}" for i in range(N_RECORDS))


def test_workers_keep_the_order_and_validation_reads_shards_in_order(shard_set, synthetic_tokenizer, vision):
    _, _, pattern = shard_set
    ref = [b.counts.ids for b in _dm(synthetic_tokenizer, vision, pattern).train_dataloader()]
    dm = _dm(synthetic_tokenizer, vision, pattern, num_workers=2, validation_data_path=pattern)
    assert [b.counts.ids for b in dm.train_dataloader()] == ref
    val = [i for b in dm.val_dataloader() for i in b.counts.ids]
    assert val == [f"r{i}" for i in range(N_RECORDS) if i % 4 < 2]  # rank 0: 1st micro-batch of each, file order


def test_blend_json_with_shards(shard_set, tmp_path, synthetic_tokenizer, vision):
    _, _, pattern = shard_set
    text = tmp_path / "text.jsonl"
    write_jsonl(text, [qa(image=None, q="hi", a="yes", rid=f"t{i}") for i in range(4)])
    kw = {"concat_sampling_probabilities": [0.5, 0.5]}
    dm = _dm(synthetic_tokenizer, vision, [str(text), pattern], mbs=4, dp_world=1, **kw)
    ids = [i for b in dm.train_dataloader() for i in b.counts.ids]
    assert len(ids) == 20 and sum(i.startswith("t") for i in ids) == 10  # 4 records upsampled to half of 20 draws
    again = _dm(synthetic_tokenizer, vision, [str(text), pattern], mbs=4, dp_world=1, **kw)
    assert [i for b in again.train_dataloader() for i in b.counts.ids] == ids


def test_config_checks_shard_specs(shard_set, tmp_path):
    _, _, pattern = shard_set
    with pytest.raises(FileNotFoundError, match=r"llava-000004\.tar is missing"):
        DataConfig(data_path=pattern.replace("000003", "000004"))
    with pytest.raises(ValueError, match="group_by_modality_length"):
        DataConfig(data_path=pattern, group_by_modality_length=True)
    with pytest.raises(ValueError, match="validation_data_path"):
        DataConfig(data_path=pattern, val_fraction=0.1)


def test_stale_index_is_recounted(tmp_path):
    shard = str(tmp_path / "s.tar")
    with webdataset.TarWriter(shard, encoder=False) as w:
        for i in range(3):
            w.write({"__key__": f"k{i}", "json": b"{}"})
    with open(index_path(shard), "w") as f:
        json.dump({"num_samples": 99, "shard_bytes": 1}, f)
    assert count_samples(shard) == 3
    assert make_shards_main(["--index", shard]) == 0
    with open(index_path(shard)) as f:
        assert json.load(f)["num_samples"] == 3


def test_printed_override_pastes_into_bash_and_hydra(tmp_path, capsys):
    """The override `make_shards` prints reaches Hydra as one pattern through bash (no brace expansion into one
    argument per shard, no Hydra dictionary), also under a directory with a space in its name."""
    import subprocess

    from neva.config import compose_config

    path = tmp_path / "data.jsonl"
    write_jsonl(path, [qa(image=None, rid=f"t{i}") for i in range(3)])
    out = tmp_path / "my shards" / "llava"
    assert make_shards_main(["--data-path", str(path), "--out", str(out), "--samples-per-shard", "1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    argv = subprocess.run(["bash", "-c", "printf '%s\\0' " + line], capture_output=True, text=True, check=True)
    args = argv.stdout.split("\0")[:-1]
    assert len(args) == 1
    cfg = compose_config(["+stage=pretrain", *args])
    assert cfg.model.data.data_path == f"{out}-{{000000..000002}}.tar"
