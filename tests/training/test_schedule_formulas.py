"""``model.optim.sched.formula``: each preset's schedule is its source's, step by step at the boundary steps.

HF's formula is transformers' own ``get_cosine_schedule_with_warmup`` (with ``TrainingArguments``' rounding of the
warmup ratio); NeMo's is transcribed below from ``nemo/core/optim/lr_scheduler.py`` (NVIDIA/NeMo ``8cfedd72``,
``WarmupAnnealHoldPolicy.get_lr`` and ``CosineAnnealing``), independently of neva's code.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup

from neva.config import OptimConfig, SchedConfig, compose_config
from neva.training.optim import build_optimizer, build_scheduler, warmup_steps
from tests.test_presets import PRESETS


def nemo_cosine_annealing(base_lrs, step, *, max_steps, min_lr, warmup_steps=None, warmup_ratio=None,
                          constant_steps=None):  # fmt: skip
    """NeMo's ``CosineAnnealing(...).get_lr()`` at ``last_epoch=step``: the rate of each parameter group."""
    warm = warmup_steps if warmup_steps is not None else int(warmup_ratio * max_steps) if warmup_ratio else 0
    const = constant_steps or 0
    decay_steps = max_steps - (const + warm)

    def linear_warmup_with_cosine(max_lr):  # _linear_warmup_with_cosine_annealing
        if warm > 0 and step <= warm:
            return max_lr * float(step) / float(warm)
        if step > warm + decay_steps:
            return min_lr
        coeff = 0.5 * (math.cos(math.pi * float(step - warm) / float(decay_steps)) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    if warm > 0 and step <= warm:  # _get_warmup_lr
        if const == 0:
            return [lr * (step + 1) / (warm + 1) for lr in base_lrs]
        return [linear_warmup_with_cosine(base_lrs[0]) for _ in base_lrs]
    if const > 0 and warm + decay_steps < step <= max_steps:  # _get_constant_lr
        return [linear_warmup_with_cosine(base_lrs[0]) for _ in base_lrs]
    if step > max_steps:
        return [min_lr for _ in base_lrs]
    if const == 0:  # _cosine_annealing over max_steps - warmup
        return [(lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (step - warm) / (max_steps - warm))) + min_lr
                for lr in base_lrs]  # fmt: skip
    return [linear_warmup_with_cosine(base_lrs[0]) for _ in base_lrs]


def neva_rates(optim: OptimConfig, max_steps: int, steps: list[int], lrs: tuple[float, ...] = ()) -> list[list[float]]:
    """The rate of every parameter group at each of ``steps``, from neva's scheduler on a real optimizer."""
    params = [("a.weight", torch.nn.Parameter(torch.zeros(2, 2)))]
    if lrs:
        optim.projector_lr = lrs[0]
        params.append(("projector.weight", torch.nn.Parameter(torch.zeros(2, 2))))
    scheduler = build_scheduler(build_optimizer(params, optim), optim, max_steps)
    return [[lam(s) * base for lam, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)] for s in steps]


def boundaries(warm: int, const: int, total: int) -> list[int]:
    marks = {0, 1, warm - 1, warm, warm + 1, total - const - 1, total - const, total - const + 1, total - 1, total}
    return sorted(s for s in marks if 0 <= s <= total + 1)


PRESET_OPTIM = {name: compose_config([f"+preset={name}"]) for name in PRESETS}


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("nemo")])
def test_nemo_presets_follow_nemo_cosine_annealing(name):
    cfg = PRESET_OPTIM[name]
    optim, total = cfg.model.optim, cfg.trainer.max_steps
    assert optim.sched.formula == "nemo"
    s = optim.sched
    steps = boundaries(s.warmup_steps, s.constant_steps, total)
    ours = neva_rates(optim, total, steps)
    for step, rates in zip(steps, ours):
        ref = nemo_cosine_annealing([optim.lr], step, max_steps=total, min_lr=s.min_lr, warmup_steps=s.warmup_steps)
        assert rates == pytest.approx(ref, rel=1e-12, abs=1e-18), (name, step)
    # the peak is reached at step W (NeMo's (W + 1) / (W + 1)), not one step earlier
    assert ours[steps.index(s.warmup_steps - 1)][0] < optim.lr == pytest.approx(ours[steps.index(s.warmup_steps)][0])


@pytest.mark.parametrize(
    "sched",
    [
        dict(warmup_steps=None, warmup_ratio=0.07, min_lr=1e-5, constant_steps=0),  # int(0.07 * 50) = 3, not ceil's 4
        dict(warmup_steps=5, warmup_ratio=None, min_lr=1e-5, constant_steps=7),  # Megatron's variant
        dict(warmup_steps=0, warmup_ratio=None, min_lr=0.0, constant_steps=4),
    ],
)
def test_nemo_formula_with_ratio_constant_steps_and_two_groups(sched):
    optim = OptimConfig(lr=1e-3, sched=SchedConfig(formula="nemo", **sched))
    total = 50
    warm = warmup_steps(optim, total)
    steps = boundaries(warm, sched["constant_steps"], total)
    for step, rates in zip(steps, neva_rates(optim, total, steps, lrs=(2e-4,))):
        # groups sorted as neva builds them: (decayed, not projector) first, then the projector's own rate
        ref = nemo_cosine_annealing([1e-3, 2e-4], step, max_steps=total, min_lr=sched["min_lr"],
                                    warmup_steps=sched["warmup_steps"], warmup_ratio=sched["warmup_ratio"],
                                    constant_steps=sched["constant_steps"])  # fmt: skip
        assert rates == pytest.approx(ref, rel=1e-12, abs=1e-18), step


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("llava15")])
@pytest.mark.parametrize("total", [4, 5197])
def test_llava_presets_follow_transformers_cosine_with_warmup(name, total):
    cfg = PRESET_OPTIM[name]
    optim = cfg.model.optim
    assert optim.sched.formula == "hf" and optim.sched.warmup_steps is None
    warm = math.ceil(optim.sched.warmup_ratio * total)  # TrainingArguments.get_warmup_steps
    reference = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    hf = get_cosine_schedule_with_warmup(reference, warm, total)
    steps = boundaries(warm, 0, total - 1)
    ours = neva_rates(optim, total, steps)
    for step, rates in zip(steps, ours):
        assert rates[0] == pytest.approx(optim.lr * hf.lr_lambdas[0](step), rel=1e-12, abs=1e-18), (name, step)
    assert ours[0][0] == 0.0


def test_hf_formula_refuses_what_hf_cannot_do():
    for bad in (dict(min_lr=1e-6), dict(constant_steps=3)):
        with pytest.raises(ValueError, match="formula=hf"):
            SchedConfig(formula="hf", **bad)
    with pytest.raises(ValueError, match="formula"):
        SchedConfig(formula="megatron")
