"""Stage two changes the architecture as LLaVA-NeXT's recipe does: pretrain at the tower's fixed resolution, then
finetune from that checkpoint adding AnyRes (pinpoints, ``image_aspect_ratio=anyres``, the merge type and its fresh
``image_newline``) or video pooling; any other architecture setting that differs from the checkpoint is refused naming
the key (``neva.checkpoint.restored_architecture``).

The two runs are ``python -m neva.train`` (forked from the session's server: ``train_forked``) on the lean tiny model
(two steps each); the rules themselves are checked in process through ``resolve_source`` on the runs' checkpoints.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from neva.checkpoint import neva_format
from neva.checkpoint.initial_weights import fresh_parameters, init_fresh, load_source_weights
from neva.checkpoint.source import resolve_source
from neva.models.trainable import build_meta_model
from neva.typed import ConfigError
from tests.data.conftest import qa, write_image, write_jsonl
from tests.data.video_files import write_video
from tests.training.conftest import LEAN
from tests.training.test_cli import ENV, train_forked

SHORT = ["trainer.max_steps=2", "model.micro_batch_size=4", "model.global_batch_size=8", "trainer.limit_val_batches=0"]
ANYRES = ["model.mm_cfg.image_grid_pinpoints='(1x1),...,(2x2)'", "model.data.image_aspect_ratio=anyres"]
VIDEO = ["model.mm_cfg.mm_spatial_pool_stride=2", "model.mm_cfg.mm_spatial_pool_mode=max"]
# Sizes around the tiny tower's 32 px tiles: 1x1, 1x2, 2x1 and 2x2 grids.
SIZES = [(32, 32), (64, 32), (32, 64), (64, 64), (50, 70), (90, 40)]


def llava_data(root: Path) -> list[str]:
    """LLaVA-format records over images of varied sizes and a few short videos (written once under ``root``), as
    overrides."""
    images, path = root / "images", root / "data.jsonl"
    if not path.exists():
        for i, size in enumerate(SIZES):
            write_image(str(images / f"{i}.png"), size=size, seed=i)
        for i in range(2):
            write_video(images / f"v{i}.mp4", frames=4)
        records = [qa(image=f"{i % len(SIZES)}.png", rid=f"s{i}") for i in range(24)]
        records += [
            {**qa(image=None, q="<video>\nWhich way?", rid=f"v{i}"), "video": f"v{i % 2}.mp4"} for i in range(8)
        ]
        write_jsonl(path, records)
    return ["data=llava", f"model.data.data_path={path}", f"model.data.image_folder={images}",
            "model.data.num_workers=0", "model.data.num_frames=4"]  # fmt: skip


def train(root: Path, exp: str, *overrides: str, stage: str) -> subprocess.CompletedProcess:
    env = {**ENV, "NEVA_OUTPUT_ROOT": str(root)}
    return train_forked(root / exp, *SHORT, *overrides, stage=stage, env=env, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A fixed-resolution pretrain (NEVA_OUTPUT_ROOT's default pretrain output), then a finetune that starts from it by
    default and adds AnyRes and video pooling (without the pooling its video records would be skipped as
    ``video_unsupported``, and the run would fail its skip check)."""
    root = tmp_path_factory.mktemp("stage_two")
    out = train(root, "pretrain", stage="pretrain")
    assert out.returncode == 0, out.stderr[-3000:]
    out = train(root, "finetune", *llava_data(root), *ANYRES, *VIDEO, stage="finetune")
    assert out.returncode == 0, out.stderr[-3000:]
    logged = [line for line in (out.stdout + out.stderr).splitlines() if "added to the architecture of" in line]
    assert len(logged) == 1 and "anyres.image_newline" in logged[0], out.stdout[-3000:]
    return root


def finetune_cfg(root: Path, *overrides: str, restore: Path | None = None):
    from neva.config import compose_config

    restore_from = [f"model.restore_from_path={restore}"] if restore else []
    return compose_config(["+stage=finetune", *LEAN, *llava_data(root), *restore_from, *overrides])


def test_finetune_adds_anyres_and_video_to_a_fixed_resolution_checkpoint(runs):
    pretrained = neva_format.load_config(runs / "pretrain" / "final")
    assert pretrained.anyres is None and pretrained.video is None
    final = runs / "finetune" / "final"
    cfg = neva_format.load_config(final)
    assert cfg.anyres is not None and cfg.anyres.grid_pinpoints == [[32, 32], [32, 64], [64, 32], [64, 64]]
    assert cfg.anyres.patch_merge_type == "spatial_unpad" and cfg.anyres.max_num_patches is None
    assert cfg.video is not None and (cfg.video.spatial_pool_stride, cfg.video.spatial_pool_mode) == (2, "max")
    assert neva_format.tensor_shapes(final)["anyres.image_newline"] == (cfg.llm.hidden_size,)


def test_the_new_newline_is_the_seeds_in_every_layout(runs, monkeypatch):
    """``image_newline`` comes from the run's seed alone: a whole-model start and a shard-by-shard one (whose fresh
    init draws in another order) hold the same values; every other tensor is the checkpoint's."""
    monkeypatch.setenv("NEVA_OUTPUT_ROOT", str(runs))
    cfg = finetune_cfg(runs, *ANYRES)
    source = resolve_source(cfg)
    assert source.checkpoint == str(runs / "pretrain" / "final") and source.added == ("anyres.image_newline",)
    models = []
    for init_seed in (cfg.model.seed, cfg.model.seed + 1):
        model = build_meta_model(source.cfg, cfg.model.trainable_policy())
        init_fresh(model, torch.device("cpu"), init_seed)
        load_source_weights([model], source)
        models.append(model.state_dict())
    expected = fresh_parameters(source.cfg, source.added, cfg.model.seed)["anyres.image_newline"]
    assert torch.equal(models[0]["anyres.image_newline"], expected)
    assert torch.equal(models[1]["anyres.image_newline"], expected)
    stored = dict(neva_format.iter_tensors(source.checkpoint))
    assert all(torch.equal(models[1][k], v) for k, v in stored.items())


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ([*ANYRES, "model.mm_cfg.mm_patch_merge_type=flat"],
         "model.mm_cfg.mm_patch_merge_type='flat' (the checkpoint has 'spatial_unpad')"),
        (["model.mm_cfg.image_grid_pinpoints='(1x1),...,(3x3)'", "model.data.image_aspect_ratio=anyres"],
         "model.mm_cfg.image_grid_pinpoints=[[32, 32]"),
        (["model.data.image_aspect_ratio=anyres_max_4"],
         "model.data.image_aspect_ratio='anyres_max_4' (the checkpoint has 'anyres')"),
        (["model.data.image_aspect_ratio=pad"], "model.data.image_aspect_ratio='pad' (the checkpoint has 'anyres')"),
        (["model.mm_cfg.mm_spatial_pool_stride=4", "model.mm_cfg.mm_spatial_pool_mode=max",
          "model.data.image_aspect_ratio=anyres"], "model.mm_cfg.mm_spatial_pool_stride=4 (the checkpoint has 2)"),
        # the stride given restates the pooling, so its mode counts even at the default (average)
        (["model.mm_cfg.mm_spatial_pool_stride=2", "model.data.image_aspect_ratio=anyres"],
         "model.mm_cfg.mm_spatial_pool_mode='average' (the checkpoint has 'max')"),
        (["++model.mm_cfg.vision_encoder.class_token_length=0", "model.data.image_aspect_ratio=anyres"],
         "class_token_length=0 (the checkpoint has 1)"),
    ],
)  # fmt: skip
def test_other_architecture_changes_are_refused_naming_the_key(runs, overrides, needle):
    """Against the finetuned (AnyRes + video) checkpoint: AnyRes and video can be added, not changed or dropped."""
    cfg = finetune_cfg(runs, *overrides, restore=runs / "finetune" / "final")
    with pytest.raises(ConfigError, match=r"model\.restore_from_path=") as err:
        resolve_source(cfg)
    assert needle in str(err.value)


def test_every_differing_setting_is_named_in_the_one_message(runs):
    both = ["model.data.image_aspect_ratio=anyres_max_4", "model.mm_cfg.mm_spatial_pool_stride=4",
            "model.mm_cfg.mm_spatial_pool_mode=max"]  # fmt: skip
    with pytest.raises(ConfigError) as err:
        resolve_source(finetune_cfg(runs, *both, restore=runs / "finetune" / "final"))
    message = str(err.value)
    assert "image_aspect_ratio='anyres_max_4'" in message and "mm_spatial_pool_stride=4" in message
    assert "\n" not in message


def test_anyres_checkpoint_restored_as_it_is_keeps_its_architecture(runs):
    cfg = finetune_cfg(runs, "model.data.image_aspect_ratio=anyres", restore=runs / "finetune" / "final")
    source = resolve_source(cfg)
    assert source.cfg == neva_format.load_config(runs / "finetune" / "final") and source.added == ()


def test_a_differing_merge_type_exits_2_with_one_line(runs):
    final = runs / "finetune" / "final"
    out = train(runs, "refused", *llava_data(runs), *ANYRES, "model.mm_cfg.mm_patch_merge_type=flat",
                f"model.restore_from_path={final}", stage="finetune")  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert "model.mm_cfg.mm_patch_merge_type='flat' (the checkpoint has 'spatial_unpad')" in line
    assert not (runs / "refused" / "final").exists()


# Layouts that materialise the added newline differently: TP2+SP (replicated DTensor), PP2 (on stage 0), and DP2
# ZeRO-3 from a model.meta_init=true start (each rank initialises only its shard, in another random order).
STAGE_TWO_LAYOUTS = {
    "tp2_sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    "pp2": ["model.pipeline_model_parallel_size=2"],
    "dp2_zero3_meta_init": ["model.data_parallel=fsdp", "model.zero_stage=3", "model.meta_init=true"],
}


@pytest.mark.slow
def test_added_anyres_trains_the_same_in_every_layout(tmp_path):
    """A fixed-resolution checkpoint restored with AnyRes added: every layout's losses and gradient norms equal one
    process's, so every layout starts from the same fresh ``image_newline``."""
    from tests.parallel.harness import FAMILIES, make_checkpoint, run_layouts, train_losses
    from tests.parallel.llava_data import llava_overrides, write_llava_set

    write_llava_set(tmp_path / "llava")
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama_clip")
    assert neva_format.load_config(ckpt).anyres is None
    data = [
        f"model.restore_from_path={ckpt}",
        *llava_overrides(tmp_path / "llava", True),
        *FAMILIES["llama_clip_anyres"],
    ]
    ref = train_losses(data, 2)
    results = run_layouts(2, [(n, data + o, 2) for n, o in STAGE_TWO_LAYOUTS.items()], tmp_path / "layouts")
    for name in STAGE_TWO_LAYOUTS:
        for rank in results:
            for key in ("losses", "grad_norms"):
                assert rank[name][key] == pytest.approx(ref[key], rel=1e-5), (name, key, rank[name][key], ref[key])
