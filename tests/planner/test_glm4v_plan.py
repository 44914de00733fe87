"""The planner on GLM-4.1V's tower (tiny): the image it plans is the one ``Glm4vImageProcessor`` makes (its budget
counted over two frames, a short side scaled up first), its FLOPs per patch (the tower's blocks over the whole image,
the downsampling merger per merged token) against a direct count, and ``neva.plan``'s CPU rehearsal of a trained
tower (the planned activations near the ones the same step allocates)."""

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

GLM4V = ["+stage=pretrain", "model=tiny_glm4v", "vision=tiny_glm4v", "cluster=dgx_h100", "trainer.devices=1",
         "model.micro_batch_size=4", "model.global_batch_size=8"]  # fmt: skip


def _config(*extra: str):
    cfg = compose_config(GLM4V + list(extra))
    return cfg, neva_config_from_mm(cfg.model.mm_cfg, image_aspect_ratio=cfg.model.data.image_aspect_ratio)


def test_planned_image_is_the_processors_and_its_flops_a_direct_count() -> None:
    from transformers import Glm4vImageProcessorPil

    cfg, ncfg = _config()
    v = ncfg.vision
    low, high = v.spec.pixels
    processor = Glm4vImageProcessorPil(
        size={"shortest_edge": low, "longest_edge": high}, patch_size=v.patch_size, merge_size=2
    )
    for size in ((48, 80), (10, 300), (900, 700)):
        load = image_load(ncfg, size, None, cfg.model.data)
        patches = processor.get_number_of_image_patches(*size, {})
        assert load.tiles == patches and load.tokens == patches // 4, (size, load, patches)
    load = image_load(ncfg, (48, 80), None, cfg.model.data)
    assert load.grid == (8, 14)  # 2 × 48·80 px under 112² (the budget's two frames): scaled up to 64×112 px

    params = model_params(build_meta_model(ncfg, cfg.model.trainable_policy()))
    mats = {n: math.prod(s) for n, s, _ in params if n.endswith("weight") and len(s) > 1}
    # the position table is resampled and added, no matmul (as Qwen3-VL's)
    tower = sum(n for k, n in mats.items() if k.startswith("vision.") and k != "vision.pos_embed.weight")
    merger = sum(n for k, n in mats.items() if k.startswith("projector."))
    terms = flop_terms(params, ncfg, load.grid)
    # the frozen tower first in line: its forward only, 2n per patch per weight, 4·P·d per patch in each block
    forward = sum(t.forward for t in terms if t.name.startswith("vision.")) * load.tiles
    assert math.isclose(forward, 2 * tower * 112 + v.num_layers * 4 * 112 * 112 * v.hidden_size, rel_tol=1e-12)
    # the trained merger (downsample Conv2d included) once per merged token
    forward = sum(t.forward for t in terms if t.name.startswith("projector.")) * load.tiles
    assert math.isclose(forward, 2 * merger * load.tokens, rel_tol=1e-12)


def test_plan_and_its_rehearsal_on_a_trained_tower(capsys) -> None:
    trained = ["model.mm_cfg.vision_encoder.freeze=false", "plan.max_pixels=131072"]
    plans = main(GLM4V + trained + ["plan.rehearse=true"])
    image = plans[0].extra["image"]
    assert (image["size"], image["grid"], image["tiles"], image["tokens"]) == ([256, 256], [32, 32], 1024, 256)
    assert "# rehearsal: one real optimizer step per rank role" in capsys.readouterr().out

    cfg, _ = _config("model.mm_cfg.vision_encoder.freeze=false")
    plan = plan_run(cfg, text_tokens=16, image_size=(256, 256), max_pixels=131072)
    real = rehearse(cfg, 16, image_size=(256, 256), fake=False)
    measured = real[0].categories["activations"]
    print("planned / measured activations:", plan.stages[0].activations, measured)
    assert abs(plan.stages[0].activations - measured) / measured < 0.15, (plan.stages[0].activations, measured)
