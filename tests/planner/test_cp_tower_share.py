"""A trained tower's activations per context-parallel rank, as planned, against a direct count of the tower inputs the
busiest cp rank encodes by the split's own rules (``ContextShard.share_sizes`` for fixed-resolution images, tiles and
frames; ``native_shares`` for a native-resolution tower's whole images). The planner reads that count from
``StepDecisions.tower_inputs``; before, it kept a native tower's whole micro-batch on every cp rank."""

from __future__ import annotations

import dataclasses

import pytest

from neva.config import TrainConfig, compose_config
from neva.models.context_shard import ContextShard, native_shares
from neva.planner.plan import plan_run

FIXED = ["+stage=pretrain", "cluster=dgx_h100", "trainer.devices=1"]
NATIVE = FIXED + ["model=tiny_qwen2_5_vl", "vision=tiny_qwen2_5_vl"]


def tower_bytes(cfg: TrainConfig, images: int, cp: int) -> float:
    """The first stage's planned activations with the tower trained minus with it frozen (everything else equal: the
    decoder's, the head's and the projector's cancel), ``images`` images per micro-batch, one cp group of ``cp``."""
    acts = []
    for freeze in (False, True):
        mm = cfg.model.mm_cfg
        mm = dataclasses.replace(mm, vision_encoder=dataclasses.replace(mm.vision_encoder, freeze=freeze))
        model = dataclasses.replace(
            cfg.model, mm_cfg=mm, micro_batch_size=images, global_batch_size=8, context_parallel_size=cp
        )
        run = dataclasses.replace(cfg, model=model, trainer=dataclasses.replace(cfg.trainer, devices=cp))
        acts.append(plan_run(run).stages[0].activations)
    return acts[0] - acts[1]


def busiest_fixed(n: int, cp: int) -> int:
    """The most of ``n`` fixed-resolution tower inputs a cp rank encodes, over the split's rotations."""
    shard = ContextShard(rank=0, size=cp, columns=None, order=None, segment_ids=None, gather=None)
    return max(max(dataclasses.replace(shard, rotation=r).share_sizes(n)) for r in range(cp))


def busiest_native(n: int, cp: int) -> int:
    """The most of ``n`` equal native-resolution images a cp rank encodes (dealt from the front and from the back)."""
    return max(max(native_shares([64] * n, cp, from_back)) for from_back in (False, True))


@pytest.mark.parametrize(
    "overrides,busiest", [(FIXED, busiest_fixed), (NATIVE, busiest_native)], ids=["fixed", "native"]
)
def test_a_trained_towers_activations_per_cp_rank_are_the_busiest_ranks_share(monkeypatch, overrides, busiest):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = compose_config(overrides)
    for images in (4, 1):  # CP2: 2 of 4 images on the busiest rank; the one image of a micro-batch of 1 on one rank
        whole = tower_bytes(cfg, images, 1)
        assert whole > 0
        assert tower_bytes(cfg, images, 2) == pytest.approx(whole * busiest(images, 2) / images, rel=1e-9)
