"""Expert-parallel layout checks (single process, fast): EP carved from dp (dp × cp), and what it refuses."""

from __future__ import annotations

import dataclasses

import pytest

from neva.config import compose_config
from neva.models.presets import build_config
from neva.parallel.expert_parallel import check_expert_parallel_layout
from neva.parallel.layout import Layout, resolve_layout
from neva.typed import ConfigError

MOE = build_config("tiny_moe").llm
DENSE = build_config("tiny").llm


def test_expert_parallel_is_carved_from_data_parallel(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    base = ["+stage=pretrain", "model.tensor_model_parallel_size=2", "model.micro_batch_size=2"]
    layout = resolve_layout(compose_config([*base, "model.expert_model_parallel_size=2"]))
    assert (layout.dp, layout.ep, layout.world) == (4, 2, 8)
    with pytest.raises(ConfigError, match="expert_model_parallel_size=3 must divide the data-parallel size 4"):
        resolve_layout(compose_config([*base, "model.expert_model_parallel_size=3"]))
    # under context parallelism from dp × cp (Megatron-Core's expert groups): every dp and cp rank holds other tokens
    cp2 = [*base, "model.context_parallel_size=2"]
    layout = resolve_layout(compose_config([*cp2, "model.expert_model_parallel_size=4"]))
    assert (layout.dp, layout.cp, layout.ep, layout.world) == (2, 2, 4, 8)
    with pytest.raises(
        ConfigError, match=r"expert_model_parallel_size=8 must divide the data- × context-parallel size 2 × 2"
    ):
        resolve_layout(compose_config([*cp2, "model.expert_model_parallel_size=8"]))


HF_FORMULA = dataclasses.replace(MOE, moe_aux_loss_formula="hf", moe_aux_loss_coeff=0.01)


@pytest.mark.parametrize(
    ("layout", "llm", "match"),
    [
        (Layout(dp=2, ep=2), DENSE, "needs an MoE model"),
        (Layout(dp=2, ep=2), dataclasses.replace(MOE, num_moe_experts=3), "not divisible"),
        (Layout(dp=2, pp=2), HF_FORMULA, "moe_aux_loss_formula=hf"),
    ],
)
def test_unsupported_combinations_are_refused_with_the_reason(layout, llm, match):
    with pytest.raises(ConfigError, match=match):
        check_expert_parallel_layout(layout, llm)
    # what is supported passes: EP with TP, PP, DDP (O2 is the precision's business)
    for ok in (Layout(dp=2, ep=2, tp=2), Layout(dp=2, ep=2, pp=2), Layout(dp=2, ep=2, data_parallel="ddp")):
        check_expert_parallel_layout(ok, MOE)
