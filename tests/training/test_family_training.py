"""The new parameter kinds of issue 20 beyond parity, through training's own step (one process): LoRA on a Qwen2
decoder behind a SigLIP tower trains the adapters and the projector only (q/k/v biases and the tied embedding stay
frozen, as docs/INTEROP.md says), and ``model.optim.vision_lr`` gives the tower its own rate on the schedule."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from neva.config import compose_config
from neva.models.lora import split_state_dict
from neva.models.neva import NevaModel
from neva.models.presets import build_config
from neva.training.optim import build_optimizer, build_scheduler
from tests.parallel.harness import FAMILIES, make_checkpoint, train_losses

FAMILY = "siglip_qwen2_tied_downsample"  # SigLIP, mlp_downsample, Qwen2 with q/k/v biases and tied embeddings


def test_lora_on_qwen2_behind_siglip_trains_adapters_and_projector_only(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", FAMILY)
    start = {k: v for f in sorted(ckpt.glob("*.safetensors")) for k, v in load_file(f).items()}
    lora = [f"model.restore_from_path={ckpt}", *FAMILIES[FAMILY], "model.peft.peft_scheme=lora"]
    run = train_losses(lora, 1, keep_engine=True)
    after, adapters = split_state_dict(run["engine"].parts[0])  # base tensors under plain names, the LoRA layers
    assert torch.isfinite(torch.tensor(run["losses"])).all()
    assert set(start) <= set(after) and {n for n in start if n.startswith("llm.") and n.endswith(".bias")}
    changed = {n for n in start if not torch.equal(start[n], after[n])}
    # only the projector moved: Qwen2's q/k/v biases, the tied embedding / LM head, the tower, every base weight not
    assert changed == {n for n in start if n.startswith("projector.")}
    assert adapters and all(layer.lora_b.weight.abs().sum() > 0 for layer in adapters.values())  # B starts at 0


@pytest.mark.parametrize("formula", ["hf", "nemo"])
def test_vision_lr_is_the_towers_own_rate_on_the_same_schedule(formula):
    optim = compose_config(
        ["+preset=llava_onevision_qwen2_7b_si", f"model.optim.sched.formula={formula}", "model.optim.sched.min_lr=0"]
    ).model.optim
    model = NevaModel(build_config("tiny_qwen2", "tiny_siglip"))
    named = list(model.named_parameters())
    optimizer = build_optimizer(named, optim)
    vision = {id(p) for n, p in named if n.startswith("vision.")}
    for group in optimizer.param_groups:
        kinds = {id(p) in vision for p in group["params"]}
        assert len(kinds) == 1  # a group is the tower's or not
        assert group["lr"] == (optim.vision_lr if kinds == {True} else optim.lr)
    scheduler = build_scheduler(optimizer, optim, 100)
    for step in (0, 1, 3, 50, 99):
        rates = [lam(step) * base for lam, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
        tower = [r for r, g in zip(rates, optimizer.param_groups) if id(g["params"][0]) in vision]
        rest = [r for r, g in zip(rates, optimizer.param_groups) if id(g["params"][0]) not in vision]
        # both follow the one schedule: the tower's rate is vision_lr / lr of the rest's at every step
        assert tower and rest
        for r in tower:
            assert r == pytest.approx(rest[0] * optim.vision_lr / optim.lr, rel=1e-9, abs=1e-15)
