"""Padded and packed batches: layout, label boundaries, image order, and packing isolation through the model."""

from __future__ import annotations

import pytest
import torch

from neva.constants import IGNORE_INDEX
from neva.data.collate import collate_packed, collate_padded, first_fit
from neva.models.media import image_media


def sample(n: int, n_img: int = 0, sid: str = "s", fill: int = 7):
    ids = torch.arange(10, 10 + n)
    labels = ids.clone()
    labels[: n // 2] = IGNORE_INDEX
    pix = torch.full((n_img, 3, 4, 4), float(fill))
    return {"id": sid, "input_ids": ids, "labels": labels, "pixel_values": pix}


def test_first_fit():
    assert first_fit([5, 3, 4, 2, 6], 8) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError):
        first_fit([9], 8)


def test_padded_layout():
    batch = collate_padded(
        [sample(5, 1, "a", 1), {"id": "x", "skipped": "missing_image"}, sample(70, 0, "b")], pad_id=0
    )
    assert batch.input_ids.shape == (2, 128)
    assert batch.counts.num_samples == 2 and batch.counts.skipped == {"missing_image": 1}
    image = batch.media.image
    assert image.items_per_row.tolist() == [1, 0] and image.pixels.shape == (1, 3, 4, 4)
    assert batch.segment_ids[0].tolist() == [1] * 5 + [0] * 123
    assert batch.position_ids[0, 1, :70].tolist() == list(range(70))
    assert (batch.labels[0, 5:] == IGNORE_INDEX).all()
    assert collate_padded([sample(5)], pad_id=0, pad_to_multiple_of=64, max_length=40).input_ids.shape == (1, 40)


def test_packed_layout_and_boundaries():
    samples = [sample(30, 1, "a", 1), sample(40, 2, "b", 2), sample(20, 0, "c"), sample(25, 1, "d", 4)]
    batch = collate_packed(samples, pad_id=0, seq_length=64, pad_to_multiple_of=16)
    # first-fit into 64: [a(30), c(20)] fill 50, [b(40)] then d(25) no room in row 0 (14 left)... → [b, ] + d? 40+25>64
    assert batch.counts.ids == ["a", "c", "b", "d"]
    assert batch.input_ids.shape == (3, 64)
    assert batch.counts.num_samples == 4
    image = batch.media.image
    assert image.items_per_row.tolist() == [1, 2, 1]
    assert image.pixels[:, 0, 0, 0].tolist() == [1, 2, 2, 4]  # row order, then position order
    seg, pos, lab = batch.segment_ids[0], batch.position_ids[0, 0], batch.labels[0]
    assert seg.tolist() == [1] * 30 + [2] * 20 + [0] * 14
    assert pos[30:50].tolist() == list(range(20))
    assert lab[30] == IGNORE_INDEX and lab[0] == IGNORE_INDEX  # nothing learned across a sample boundary


def test_all_skipped_batch_is_inert():
    batch = collate_packed([{"id": "x", "skipped": "too_long"}], pad_id=0, seq_length=64)
    assert batch.counts.num_samples == 0 and batch.input_ids.shape[0] == 1
    assert (batch.labels == IGNORE_INDEX).all() and batch.media.image is None
    assert (batch.segment_ids == 1).all()


def _loss(logits, labels):
    try:
        from neva.models.loss import token_cross_entropy

        return token_cross_entropy(logits, labels)
    except ImportError:
        flat = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX,
            reduction="sum",
        )  # fmt: skip
        return flat, (labels[:, 1:] != IGNORE_INDEX).sum()


def test_packed_loss_equals_token_weighted_loss_one_by_one(synthetic_tokenizer):
    neva_mod = pytest.importorskip("neva.models.neva")
    from neva.data import DataConfig, NevaDataModule
    from neva.models.presets import build_config

    torch.manual_seed(0)
    cfg = build_config(image_token_id=synthetic_tokenizer.convert_tokens_to_ids("<image>"))
    model = neva_mod.NevaModel(cfg)
    model.init_weights()
    model.eval()
    dm = NevaDataModule(
        DataConfig(packing=True, seq_length=512, synthetic_train_samples=16), synthetic_tokenizer, cfg,
        micro_batch_size=6,
    )  # fmt: skip
    packed = next(iter(dm.train_dataloader()))
    assert packed.input_ids.shape[0] < 6  # really packed
    dm1 = NevaDataModule(DataConfig(synthetic_train_samples=16), synthetic_tokenizer, cfg, micro_batch_size=1)
    dm1.setup()
    ds = dm1.train_datasets[0]
    by_id = {r["id"]: i for i, r in enumerate(ds.records)}
    keys = ("input_ids", "position_ids", "segment_ids")
    with torch.no_grad():
        total, count = _loss(model(**{k: getattr(packed, k) for k in keys}, media=packed.media), packed.labels)
        ref_sum, ref_n = 0.0, 0
        for sid in packed.counts.ids:
            s = ds[by_id[sid]]
            logits = model(s["input_ids"][None], image_media(s["pixel_values"], torch.tensor([1])))
            ls, n = _loss(logits, s["labels"][None])
            ref_sum, ref_n = ref_sum + ls, ref_n + n
    assert int(count) == int(ref_n)
    torch.testing.assert_close(total / count, ref_sum / ref_n, rtol=1e-4, atol=1e-5)
