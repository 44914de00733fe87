"""Expert-parallel layout checks (single process, fast): EP carved from dp, and what it does not yet combine with."""

from __future__ import annotations

import pytest

from neva.config import compose_config
from neva.models.presets import build_config
from neva.parallel.expert_parallel import check_expert_parallel_layout
from neva.parallel.layout import Layout, resolve_layout
from neva.parallel.precision import Precision
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


@pytest.mark.parametrize(
    ("layout", "llm", "fsdp", "o2", "match"),
    [
        (Layout(dp=2, ep=2), DENSE, True, False, "needs an MoE model"),
        (Layout(dp=2, tp=2), MOE, True, False, "tensor_model_parallel_size > 1 is not supported"),
        (Layout(dp=2, pp=2, ep=2), MOE, True, False, "pipeline_model_parallel_size > 1"),
        (Layout(dp=2, ep=2, data_parallel="ddp"), MOE, False, False, "data_parallel=ddp"),
        (Layout(dp=2, ep=2), MOE, True, True, "megatron_amp_O2"),
    ],
)
def test_unsupported_combinations_are_refused_with_the_reason(layout, llm, fsdp, o2, match):
    precision = Precision(master_weights=o2)
    with pytest.raises(ConfigError, match=match):
        check_expert_parallel_layout(layout, llm, fsdp, precision)
    check_expert_parallel_layout(Layout(dp=2, ep=2), MOE, True, Precision())  # what is supported passes
