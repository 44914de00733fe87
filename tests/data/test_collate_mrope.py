"""M-RoPE positions through the batch path: the collator writes each sample's own ``[3, n]`` positions (one-axis
samples broadcast over the axes; ``position_axes`` fixes P for text-only batches), ``MicroBatch.joined`` and pipeline padding
keep all three axes."""

import torch

from neva.data.collate import Collator
from neva.data.micro_batch import pad_micro_batches


def sample(n: int, index: int, axes: int | None) -> dict:
    ids = torch.arange(1, n + 1) + 10 * index
    out = dict(input_ids=ids, labels=ids.clone(), pixel_values=torch.zeros(0, 3, 4, 4), image_count=0, id=index)
    if axes is not None:  # distinct values per axis and sample
        out["position_ids"] = torch.arange(n) + 100 * index + 1000 * torch.arange(axes)[:, None]
    return out


def test_positions_per_sample_packed_padded_joined_and_pipeline_padded():
    samples = [sample(5, 1, 3), sample(3, 2, None), sample(4, 3, 3)]
    packed = Collator(0, seq_length=9, pad_to_multiple_of=1, packing=True)(samples)
    assert packed.segment_ids.tolist() == [[1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 0, 0, 0, 0]]
    pos = packed.position_ids
    assert pos.shape == (3, 2, 8)
    assert torch.equal(pos[:, 0, :5], samples[0]["position_ids"])
    assert torch.equal(pos[:, 0, 5:8], torch.arange(3).expand(3, -1))  # text only: equal axes
    assert torch.equal(pos[:, 1, :4], samples[2]["position_ids"])
    assert pos[:, 1, 4:].eq(0).all()  # padding
    joined = packed.joined()
    assert joined.position_ids.shape == (3, 1, 12)
    assert torch.equal(joined.position_ids[:, 0], torch.cat([pos[:, 0, :8], pos[:, 1, :4]], dim=1))
    (padded,) = pad_micro_batches([packed], shape=(3, 12))
    assert padded.position_ids.shape == (3, 3, 12)
    assert torch.equal(padded.position_ids[:, :2, :8], pos) and padded.position_ids[:, 2:].eq(0).all()


def test_one_axis_batches_unchanged_and_position_axes_fixes_p():
    text_only = [sample(4, 1, None), sample(2, 2, None)]
    one = Collator(0, seq_length=8, pad_to_multiple_of=1)(text_only).position_ids
    assert one.tolist() == [[[0, 1, 2, 3], [0, 1, 0, 0]]]
    three = Collator(0, seq_length=8, pad_to_multiple_of=1, position_axes=3)(text_only).position_ids
    assert torch.equal(three, one.expand(3, -1, -1))
    empty = Collator(0, seq_length=4, pad_to_multiple_of=1, position_axes=3)([])  # all skipped: one inert row
    assert torch.equal(empty.position_ids, torch.arange(1).expand(3, 1, 1))
