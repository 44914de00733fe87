"""The start-of-run line (``neva.planner.forecast``): neva.plan's numbers for the run's own layout, its multi-node
scaling efficiency, a faster fitting layout from neva.plan's search, and no numbers for an unknown device."""

from __future__ import annotations

import pytest

from neva.config import compose_config
from neva.plan import main as plan_main
from neva.planner.forecast import FASTER, forecast_line
from neva.planner.plan import plan_run
from neva.planner.search import search

TINY = ["+stage=finetune", "cluster=dgx_a100", "trainer.devices=2", "model.micro_batch_size=1"]


@pytest.mark.parametrize("extra", [["model.global_batch_size=2"], ["trainer.num_nodes=2", "model.global_batch_size=8"]])
def test_numbers_are_neva_plans_for_the_same_config(extra, capsys):
    line = forecast_line(compose_config(TINY + extra))
    (plan,) = plan_main(TINY + extra)
    capsys.readouterr()
    assert f"{plan.time.step:.4g} s/step, {plan.samples_per_s:.1f} samples/s, MFU {100 * plan.mfu:.1f}%" in line
    assert ("scaling efficiency" in line) == ("trainer.num_nodes=2" in extra)


def test_multi_node_efficiency_is_against_one_node_at_the_same_per_node_batch():
    cfg = compose_config(TINY + ["trainer.num_nodes=2", "model.global_batch_size=8"])
    two = plan_run(cfg)
    one = plan_run(compose_config(TINY + ["model.global_batch_size=4"]))
    assert (
        f"scaling efficiency {100 * two.samples_per_s / (2 * one.samples_per_s):.0f}% of 2 x one node"
        in forecast_line(cfg)
    )


def test_a_faster_fitting_layout_is_named_with_its_overrides():
    slow = TINY + ["model.global_batch_size=8", "model.tensor_model_parallel_size=2",
                   "model.activations_checkpoint_granularity=full"]  # fmt: skip
    cfg = compose_config(slow)
    line = forecast_line(cfg)
    best = search(cfg, top=1).plans[0]
    assert best.samples_per_s >= FASTER * plan_run(cfg).samples_per_s
    overrides = line.rsplit(": ", 1)[1].split()
    assert "model.tensor_model_parallel_size=1" in overrides
    taken = plan_run(compose_config(slow + overrides))
    assert taken.samples_per_s == best.samples_per_s and taken.fits


def test_no_numbers_for_an_unknown_device():
    line = forecast_line(compose_config(["+stage=finetune"]))  # cluster=local: CPU or an unknown GPU
    assert line.startswith("plan: no prediction for cluster=local")
    assert "s/step" not in line and "%" not in line and "samples/s" not in line


class Forecast(Exception):
    """Raised by the forecast below: it ran, and before anything of the run was built."""


def _stop(cfg):
    raise Forecast(cfg.trainer.num_nodes)


def test_rank_0_forecasts_before_anything_is_built(monkeypatch, tmp_path):
    from neva.training.run import run

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(Forecast):
        run(compose_config(TINY + ["model.global_batch_size=2", f"exp_manager.exp_dir={tmp_path}"]), forecast=_stop)
    assert not any(tmp_path.iterdir())
