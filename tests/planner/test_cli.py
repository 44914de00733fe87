"""``python -m neva.plan``: sweeps without ``-m``, one row per value, a final JSON line; layout arithmetic."""

from __future__ import annotations

import json

import pytest

from neva.parallel.layout import Layout
from neva.plan import main, parse_args
from neva.planner.deployment import precision_kind
from neva.planner.params import chunk_len, stage_layers
from neva.typed import ConfigError


def test_sweep_prints_one_row_per_value_and_json(capsys) -> None:
    plans = main(["cluster=dgx_a100", "trainer.devices=2", "model.micro_batch_size=4", "trainer.num_nodes=1,2"])
    # (lines starting with "#" are the plan's notes under the table: its caveats)
    lines = [line for line in capsys.readouterr().out.strip().splitlines() if not line.startswith("#")]
    assert len(lines) == 4  # header, 2 rows, JSON
    rows = json.loads(lines[-1])
    assert [r["nodes"] for r in rows] == [1, 2]
    # Weak scaling: the global batch grows with the nodes, per-rank work stays the same.
    assert rows[1]["layout"]["global_batch_size"] == 2 * rows[0]["layout"]["global_batch_size"]
    assert plans[0].deployment.layout.grad_accum == plans[1].deployment.layout.grad_accum
    assert rows[0]["memory_gib"]["total"] > 0 and rows[0]["samples_per_s"] > 0


def test_parse_args_defaults_and_errors() -> None:
    req = parse_args(["-m", "trainer.num_nodes=1,2,4", "plan.text_tokens=50", "model.optim.betas=[0.9,0.95]"])
    assert req.fixed[0] == "+stage=pretrain"
    assert req.sweeps == [("trainer.num_nodes", ["1", "2", "4"])]
    assert req.text_tokens == 50
    assert "model.optim.betas=[0.9,0.95]" in req.fixed
    with pytest.raises(ConfigError):
        parse_args(["model.optim.lr=1,2"])
    with pytest.raises(ConfigError):
        parse_args(["plan.nope=1"])


def test_pipeline_split_and_chunks() -> None:
    assert stage_layers(10, Layout(pp=4)) == [[0, 1], [2, 3], [4, 5, 6], [7, 8, 9]]
    assert stage_layers(10, Layout(pp=3, first_stage_layers=2)) == [[0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]
    assert stage_layers(8, Layout(pp=2, vpp=2)) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # Virtual chunks follow training's split: the remainder on the last chunks, pipeline_first_stage_layers on chunk 0.
    assert stage_layers(6, Layout(pp=2, vpp=2)) == [[0, 2, 3], [1, 4, 5]]
    assert stage_layers(6, Layout(pp=2, vpp=2, first_stage_layers=2)) == [[0, 1, 3], [2, 4, 5]]
    assert [chunk_len(17, 2, r) for r in range(2)] == [9, 8]
    assert [chunk_len(3, 4, r) for r in range(4)] == [1, 1, 1, 0]


def test_precision_follows_training() -> None:
    assert precision_kind("bf16", True) == ("o2", 2)
    assert precision_kind("bf16-true", False) == ("fp32", 2)  # training autocasts: fp32 storage, bf16 compute
    assert precision_kind("32", False) == ("fp32", 4)
    assert precision_kind("16-true", False) == ("half", 2)  # fp16, which training refuses: modelled pure half
    with pytest.raises(ConfigError):
        precision_kind("32", True)


def test_video_samples_count_frames_times_tower_and_tokens() -> None:
    """``plan.num_frames``: each sample one video; the planner's FLOPs are the training count (``SampleFlops``) of a
    sample of that many frames and ``video_tokens(frames)`` positions."""
    from neva.checkpoint.architecture import neva_config_from_mm
    from neva.config import compose_config
    from neva.models.flops import SampleFlops
    from neva.models.trainable import build_meta_model
    from neva.planner.plan import plan_run, sample_tokens

    assert parse_args(["plan.num_frames=8"]).num_frames == 8
    base = ["+stage=pretrain", "cluster=dgx_a100", "trainer.devices=2", "model.micro_batch_size=4"]
    cfg = compose_config([*base, "model.mm_cfg.mm_spatial_pool_stride=2"])
    ncfg = neva_config_from_mm(cfg.model.mm_cfg)
    plan = plan_run(cfg, text_tokens=40, num_frames=8)
    seq = sample_tokens(cfg, ncfg.video_tokens(8), 40)
    assert plan.seq_len == seq
    model = build_meta_model(ncfg, cfg.model.trainable_policy())
    assert plan.flops_per_sample == pytest.approx(SampleFlops.of(model).batch([seq], 0, frames=8), rel=1e-12)
    with pytest.raises(ConfigError, match="num_frames needs a video model"):
        plan_run(compose_config(base), num_frames=8)


def test_anyres_image_workload_follows_the_data_rule(capsys) -> None:
    """AnyRes plans: positions per image from the data side's rule (``NevaConfig.image_tokens``), the tower and
    projector FLOPs × tiles; the worst case by default, ``plan.image_size`` for a typical image; the output says so."""
    from neva.checkpoint.architecture import neva_config_from_mm
    from neva.config import compose_config
    from neva.planner.plan import sample_tokens

    base = ["+stage=finetune", "cluster=dgx_a100", "trainer.devices=2", "model.micro_batch_size=1",
            "vision=clip_vit_l14_336"]  # fmt: skip
    anyres = ["model.mm_cfg.image_grid_pinpoints='(1x1),...,(6x6)'", "model.data.image_aspect_ratio=anyres_max_9"]
    fixed, worst, typical = (main(base + extra)[0] for extra in ([], anyres, [*anyres, "plan.image_size=672x1008"]))
    out = capsys.readouterr().out
    assert "# AnyRes images of 2016x2016 px: 37 tiles" in out and "672x1008 px: 7 tiles" in out
    cfg = compose_config(base + anyres)
    ncfg = neva_config_from_mm(cfg.model.mm_cfg, image_aspect_ratio=cfg.model.data.image_aspect_ratio)
    assert worst.extra["image"] == {"tokens": ncfg.image_tokens((2016, 2016)), "tiles": 37, "size": [2016, 2016]}
    assert typical.extra["image"]["tokens"] == ncfg.image_tokens((672, 1008)) < worst.extra["image"]["tokens"]
    assert fixed.extra["image"] == {"tokens": 576, "tiles": 1, "size": None}
    for plan in (fixed, worst, typical):  # the decoder's sequence: those positions + the text, padded as collated
        assert plan.seq_len == sample_tokens(cfg, plan.extra["image"]["tokens"], None)
    # the tower's FLOPs: 37 and 7 tiles of the fixed image's; the decoder's grow with the positions
    assert worst.flops_per_sample > typical.flops_per_sample > fixed.flops_per_sample
