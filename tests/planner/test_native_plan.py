"""The planner on a native-resolution tower (tiny Qwen2.5-VL): the image it plans at a pixel budget (``plan.max_pixels``
or ``plan.image_size`` resized), its tower's FLOPs per patch with window and full attention counted over that image,
and ``neva.plan`` with its CPU rehearsal (fake tensors allocate what real ones do; the planned activations near the
rehearsed ones)."""

from __future__ import annotations

import math

from neva.checkpoint.architecture import neva_config_from_mm
from neva.config import compose_config
from neva.models.flops import flop_terms, model_params
from neva.models.trainable import build_meta_model
from neva.plan import main
from neva.planner.images import image_load
from neva.planner.plan import plan_run
from neva.training.rehearsal import rehearse

NATIVE = ["+stage=pretrain", "model=tiny_qwen2_5_vl", "vision=tiny_qwen2_5_vl", "cluster=dgx_h100", "trainer.devices=1",
          "model.micro_batch_size=4", "model.global_batch_size=8"]  # fmt: skip


def _config(*extra: str):
    cfg = compose_config(NATIVE + list(extra))
    return cfg, neva_config_from_mm(cfg.model.mm_cfg, image_aspect_ratio=cfg.model.data.image_aspect_ratio)


def test_tower_flops_of_the_planned_image_against_a_direct_count() -> None:
    """A 48x80 image (budget 16·16·20 px, factor 16: kept) = 6x10 patches of 8 px; block 0 attends 32 px windows (2x2
    merged tokens of 2x2 patches: windows of 16, 16, 8, 8, 8 and 4 patches), block 1 the whole image. The tower, frozen and
    first in line, costs its forward only: 2n per patch per weight, 4·L·d per patch for attention with L the keys of
    its window or image, counted here patch by patch."""
    cfg, ncfg = _config("++model.data.max_pixels=5120")
    load = image_load(ncfg, (48, 80), None, cfg.model.data)
    assert (load.size, load.grid, load.tiles, load.tokens) == ((48, 80), (6, 10), 60, 15)
    assert image_load(ncfg, None, None, cfg.model.data, 4096).grid == (8, 8)  # the budget's largest: 64x64 px

    v = ncfg.vision
    window = {}  # patches per (window row, window column): a patch's merged token, then its 2x2-token window
    for i in range(6):
        for j in range(10):
            key = (i // 2 // 2, j // 2 // 2)
            window[key] = window.get(key, 0) + 1
    keys = {0: sum(n * n for n in window.values()), 1: 60 * 60}  # Σ over patches of the keys each attends
    params = model_params(build_meta_model(ncfg, cfg.model.trainable_policy()))
    weights = sum(math.prod(s) for n, s, _ in params if n.startswith("vision.") and n.endswith("weight") and len(s) > 1)
    direct = 2 * weights * 60 + sum(4 * keys[i] * v.hidden_size for i in (0, 1))

    terms = flop_terms(params, ncfg, load.grid)
    tower = [t for t in terms if t.name.startswith("vision.")]
    assert all(t.backward == 0 for t in tower)  # frozen, nothing trained upstream
    assert math.isclose(sum(t.forward for t in tower) * load.tiles, direct, rel_tol=1e-12)
    assert sorted(window.values()) == [4, 8, 8, 8, 16, 16]


def test_plan_and_its_rehearsal_on_a_trained_native_tower(capsys) -> None:
    """``neva.plan`` plans the budget's largest image (256x256 px at 65536: 32x32 patches, 256 positions) and
    rehearses it on fake tensors (the tower reads the loader's real grid); the planned activations are within 15% of
    the ones the same step allocates on real tensors (a trained tower and merger)."""
    trained = ["model.mm_cfg.vision_encoder.freeze=false", "plan.max_pixels=65536"]
    plans = main(NATIVE + trained + ["plan.rehearse=true"])
    image = plans[0].extra["image"]
    assert (image["size"], image["grid"], image["tiles"], image["tokens"]) == ([256, 256], [32, 32], 1024, 256)
    assert "# rehearsal: one real optimizer step per rank role" in capsys.readouterr().out

    cfg, _ = _config("model.mm_cfg.vision_encoder.freeze=false")
    plan = plan_run(cfg, text_tokens=16, image_size=(256, 256), max_pixels=65536)
    real = rehearse(cfg, 16, image_size=(256, 256), fake=False)
    measured = real[0].categories["activations"]
    print("planned / measured activations:", plan.stages[0].activations, measured)
    assert abs(plan.stages[0].activations - measured) / measured < 0.15, (plan.stages[0].activations, measured)


def test_plan_says_what_it_cannot_know() -> None:
    """Issue 52: the Qwen2.5-VL preset planned "fits" at 76.8 of 80 GiB with no word of its uncertainty, at the mean
    sample although it packs rows of 8192, and its ZeRO-2 gradients unsharded without saying why: one line each."""
    from neva.planner.caveats import caveat_lines

    cfg = compose_config(["+preset=qwen_vl_finetune_qwen2_5_vl_7b"])
    plan = plan_run(cfg)
    lines = caveat_lines(cfg, [plan])
    close = f"fits at {plan.peak.total / 2**30:.1f} of 80 GiB"
    assert any(close in line and "rehearse" in line for line in lines), lines
    row = cfg.model.data.seq_length * cfg.model.micro_batch_size
    assert any("rows up to 8192" in line and f"would be {row} tokens" in line for line in lines), lines
    assert any("reduce-scatters every micro-batch" in line for line in lines), lines
    far = compose_config(NATIVE)  # tiny: far from the limit, no packing, no accumulation
    assert caveat_lines(far, [plan_run(far)]) == []
