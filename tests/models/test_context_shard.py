"""Attention of a context-parallel shard (``neva.models.context_shard``) equals the one-process attention at its
columns: every cp rank simulated in one process, each rank's ``gather`` answering with every rank's keys/values."""

import pytest
import torch

from neva.models.attention import plan_attention, shard_mask_mod
from neva.models.context_shard import ContextShard

from .test_attention import SEGMENTS, S, dense_reference, qkv


def columns_of(rank: int, cp: int, length: int = S) -> torch.Tensor:
    """Chunks ``rank`` and ``2·cp − 1 − rank`` of ``2·cp`` (Megatron's load-balanced causal split)."""
    chunk = length // (2 * cp)
    return torch.cat([torch.arange(rank, rank + 1) * chunk + torch.arange(chunk),
                      torch.arange(2 * cp - 1 - rank, 2 * cp - rank) * chunk + torch.arange(chunk)])  # fmt: skip


def shards(cp: int, segments: torch.Tensor, kv: torch.Tensor) -> list[ContextShard]:
    """Every rank's shard; ``kv`` (``[2, B, H, S, D]``, stacked keys and values of the whole rows) is what the
    ranks' gathers together hold: rank r's part is its columns of it."""
    cols = [columns_of(r, cp) for r in range(cp)]
    order = torch.argsort(torch.cat(cols))

    def gather(t, dim, sizes):
        assert sizes == [S // cp] * cp and t.shape[dim] == S // cp
        return torch.cat([kv.index_select(dim, c) for c in cols], dim)

    return [ContextShard(r, cp, cols[r], order, segments, gather) for r in range(cp)]


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("window", [None, 7])
def test_shards_attend_as_one_process(cp, window):
    q, k, v = qkv(4, 2)
    ref_plan = plan_attention(SEGMENTS, S, 0, torch.device("cpu"), window=window)
    expected = ref_plan.attend(q, k, v)
    w = torch.randn_like(expected)
    kv = torch.stack([k, v])
    total = 0.0
    for shard in shards(cp, SEGMENTS, kv):
        plan = plan_attention(None, S // cp, 0, torch.device("cpu"), window=window, shard=shard)
        assert plan.kind == "segments"
        cols = shard.columns
        out = plan.attend(q[:, :, cols], k[:, :, cols], v[:, :, cols])
        torch.testing.assert_close(out, expected[:, :, cols])
        total = total + (out * w[:, :, cols]).sum()
    grads = torch.autograd.grad(total, (q, k, v))
    for g, e in zip(grads, torch.autograd.grad((expected * w).sum(), (q, k, v))):
        torch.testing.assert_close(g, e)


def test_flex_shard_mask_equals_dense_mask():
    """The CUDA path's query-column ``mask_mod``, run by FlexAttention's reference implementation on CPU."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = (t.detach() for t in qkv(4, 2))
    expected = dense_reference(q, k, v, SEGMENTS)
    for rank in range(2):
        cols = columns_of(rank, 2)
        mask = create_block_mask(shard_mask_mod(cols, SEGMENTS), 2, None, S // 2, S, device="cpu", _compile=False)
        with torch.no_grad():
            got = flex_attention(q[:, :, cols], k, v, block_mask=mask, enable_gqa=True)
        torch.testing.assert_close(got, expected[:, :, cols])


def test_tower_inputs_are_shared_out_evenly():
    """Contiguous shares differing by at most one input; the remainder moves on with ``rotation`` (per micro-batch)
    and ``turn`` (per modality), so no rank takes every remainder."""

    def shard(rotation: int = 0) -> ContextShard:
        return ContextShard(0, 3, torch.arange(2), torch.arange(6), SEGMENTS, gather=None, rotation=rotation)

    assert shard().share_sizes(7) == [3, 2, 2]
    assert shard().share_sizes(7, turn=1) == [2, 3, 2]
    assert [shard(t).share_sizes(4) for t in range(3)] == [[2, 1, 1], [1, 2, 1], [1, 1, 2]]


def test_native_items_are_shared_out_by_patches():
    """Whole native items (patch counts of their grids), contiguous runs, each rank's patches within one item of an
    equal share; equal items' ties fall the other way from the back (odd micro-batches)."""
    from neva.models.context_shard import native_shares

    # 2304 patches: the third item's middle (768) in rank 0's half, the fourth's (1792) in rank 1's: 1280 | 1024
    assert native_shares([128, 128, 1024, 1024], 2) == [3, 1]
    assert native_shares([64, 64, 64], 2) == [1, 2] and native_shares([64, 64, 64], 2, from_back=True) == [2, 1]
    assert native_shares([], 2) == [0, 0] and native_shares([100], 3) == [0, 1, 0]
    generator = torch.Generator().manual_seed(0)
    for size in (2, 3, 4):
        patches = (torch.randint(1, 60, (23,), generator=generator) * 16).tolist()
        counts = native_shares(patches, size)
        assert sum(counts) == len(patches)
        ends = torch.tensor(counts).cumsum(0).tolist()
        loads = [sum(patches[a:b]) for a, b in zip([0, *ends[:-1]], ends)]
        assert max(abs(load - sum(patches) / size) for load in loads) <= max(patches)
