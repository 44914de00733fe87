"""The typed micro-batch (``neva.data.micro_batch``): Lightning moves it whole, pytree maps see its tensors, and its
reshapings (pad, join, split) carry every per-token tensor with its tokens, a stage's own ones too."""

import pytorch_lightning as pl
import torch
import torch.utils._pytree as pytree

from neva.constants import IGNORE_INDEX
from neva.data.collate import collate_packed
from neva.data.micro_batch import MicroBatch, RolloutRows, SampleCounts, pad_micro_batches
from neva.models.media import Media, MediaInputs


def _sample(n: int, sid: str, images: int = 0) -> dict:
    ids = torch.arange(10, 10 + n)
    return {"input_ids": ids, "labels": ids.clone(), "pixel_values": torch.zeros(images, 3, 4, 4, dtype=torch.uint8),
            "image_positions": torch.arange(images), "id": sid}  # fmt: skip


def _rollout_batch() -> MicroBatch:
    ids = torch.tensor([[5, 6, 7, 8], [5, 9, 0, 0]])
    labels = torch.tensor([[IGNORE_INDEX, 6, 7, 8], [IGNORE_INDEX, 9, IGNORE_INDEX, IGNORE_INDEX]])
    image = MediaInputs(torch.zeros(1, 3, 4, 4), torch.tensor([[0, 1]]), items_per_row=torch.tensor([1, 0]),
                        grid=torch.tensor([[1, 2, 2]]))  # fmt: skip
    return MicroBatch(
        input_ids=ids, labels=labels, position_ids=torch.arange(4).expand(1, 2, 4), segment_ids=(ids > 0).long(),
        media=Media(image=image), counts=SampleCounts(num_samples=2, ids=["a", "b"]),
        stage=RolloutRows(advantages=torch.tensor([0.5, -0.5]), old_token_logps=torch.randn(2, 4)),
    )  # fmt: skip


def test_lightning_moves_it_whole_and_pytree_sees_its_tensors():
    batch = _rollout_batch()
    # what Lightning does to the list of a step's micro-batches before training_step (``.to`` of each)
    (moved,) = pl.LightningModule().transfer_batch_to_device([batch], torch.device("meta"), 0)
    assert isinstance(moved, MicroBatch) and moved.counts == batch.counts
    for name in ("input_ids", "labels", "position_ids", "segment_ids"):
        assert getattr(moved, name).device.type == "meta", name
    assert moved.stage.advantages.device.type == "meta" and moved.stage.old_token_logps.device.type == "meta"
    assert moved.media.image.pixels.device.type == "meta" and moved.media.image.positions.device.type == "meta"
    assert moved.media.image.grid.device.type == "cpu"  # the tower reads it as host integers (``MediaInputs.to``)

    cloned = pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, batch)
    assert isinstance(cloned, MicroBatch) and isinstance(cloned.stage, RolloutRows)
    assert cloned.input_ids is not batch.input_ids and torch.equal(cloned.input_ids, batch.input_ids)
    assert cloned.media.image.pixels is not batch.media.image.pixels
    assert cloned.stage.old_token_logps is not batch.stage.old_token_logps
    leaves = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    assert any(t is batch.stage.advantages for t in leaves) and any(t is batch.media.image.pixels for t in leaves)


def test_padding_carries_the_stages_per_token_tensors():
    batch = _rollout_batch()
    (padded,) = pad_micro_batches([batch], multiple=8)
    assert padded.shape == (2, 8) and padded.media.image.items_per_row.tolist() == [1, 0]
    old = padded.stage.old_token_logps
    assert torch.equal(old[:, :4], batch.stage.old_token_logps) and not old[:, 4:].any()
    assert (padded.labels[:, 4:] == IGNORE_INDEX).all() and not padded.segment_ids[:, 4:].any()
    assert torch.equal(padded.stage.advantages, batch.stage.advantages)  # per row, not per token
    assert padded.counts is batch.counts and batch.shape == (2, 4)  # the original is left as it was


def test_joining_and_splitting_keep_every_token_with_its_tensors():
    batch = collate_packed([_sample(5, "a", 1), _sample(6, "b"), _sample(3, "c", 1)], 0, seq_length=8)
    assert batch.shape[0] == 2
    keys = torch.arange(batch.input_ids.numel()).view(batch.shape) + 100  # a per-token tensor to follow
    batch = batch.with_(dropout_keys=keys)
    real = batch.segment_ids > 0
    joined = batch.joined()
    assert torch.equal(joined.input_ids[0], batch.input_ids[real]) and torch.equal(joined.dropout_keys[0], keys[real])
    assert torch.equal(joined.targets, batch.targets)
    old, new = batch.media.image.positions, joined.media.image.positions
    assert torch.equal(joined.input_ids[0, new[:, 1]], batch.input_ids[old[:, 0], old[:, 1]])

    cp, length = 2, batch.shape[1]
    shares = [batch.split_columns(cp, r, gather=None, packed=True) for r in range(cp)]
    whole = -(-length // (2 * cp)) * (2 * cp)
    assert all(s.labels is None and s.next_labels is not None for s in shares)
    order = shares[0].context.order  # the rows' columns, from every rank's columns laid end to end
    for name in ("input_ids", "dropout_keys"):
        gathered = torch.cat([getattr(s, name) for s in shares], dim=1)[:, order]
        assert torch.equal(gathered[:, :length], getattr(batch, name)), name
        assert gathered.shape[1] == whole
    following = torch.cat([s.next_labels for s in shares], dim=1)[:, order]
    assert torch.equal(following[:, : length - 1], batch.labels[:, 1:])
    # every learned position lands on exactly one rank, with its target
    assert sum(s.targets.numel() for s in shares) == batch.targets.numel()
