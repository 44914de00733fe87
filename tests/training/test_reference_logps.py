"""Precomputed reference log-probs (``model.dpo.precompute_ref_log_probs=true``, ``neva.training.reference_logps``):
two steps trained from the run's one-pass values equal the steps with the live reference (loss, gradient norm, every
reward metric); the reference is dropped before training, and not built by a restarted run that finds the file
complete; the pass is resumable (a pass preempted after some micro-batches continues with only the rest and ends with
the uninterrupted pass's values) and keyed (a file of other data is refused, naming it)."""

from __future__ import annotations

import pytest
import torch

from neva.checkpoint.source import resolve_source
from neva.config import compose_config
from neva.errors import ConfigError
from neva.parallel.layout import resolve_layout
from neva.training.reference_logps import FILE, precompute_reference_logps, reference_key
from tests.parallel.harness import make_checkpoint, train_losses
from tests.parallel.test_dpo_layouts import DPO_BASE

pytestmark = pytest.mark.slow


class Preempted(Exception):
    pass


def test_precomputed_reference_equals_live_and_the_pass_resumes(tmp_path):
    restore = [f"model.restore_from_path={make_checkpoint(tmp_path / 'ft')}", "model.global_batch_size=4"]
    live = train_losses(restore, steps=2, base=DPO_BASE, keep_engine=True)
    run_dir = tmp_path / "run"
    precomputed = ["model.dpo.precompute_ref_log_probs=true", f"exp_manager.exp_dir={run_dir}"]
    pre = train_losses(restore + precomputed, steps=2, base=DPO_BASE, keep_engine=True)
    assert (run_dir / FILE).exists() and pre["engine"].head.reference is None  # one pass, then no reference model
    assert live["aux_metrics"][1]["rewards/margin"] != 0
    for key in ("losses", "grad_norms"):
        assert pre[key] == pytest.approx(live[key], rel=1e-6, abs=1e-7), key
    for got, want in zip(pre["aux_metrics"], live["aux_metrics"], strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
    # A restarted run finds the file complete: no pass, no rewrite, the same first step.
    written = (run_dir / FILE).stat().st_mtime_ns
    again = train_losses(restore + precomputed, steps=1, base=DPO_BASE)
    assert (run_dir / FILE).stat().st_mtime_ns == written and again["losses"] == pre["losses"][:1]

    # The pass itself, on the live run's pairs, with a reference built as the run builds it (the starting weights).
    cfg = compose_config(DPO_BASE + restore + precomputed)
    layout, source = resolve_layout(cfg), resolve_source(cfg)
    engine, data = live["engine"], live["data"]
    reference = make_reference(cfg, source, layout, engine)
    datasets = data.train_datasets
    key = reference_key(
        [d.base.records for d in datasets], datasets[0].base.settings, source, False, str(cfg.trainer.precision)
    )
    args = (datasets, data.collator)
    full = precompute_reference_logps(*args, reference, engine, tmp_path / "a" / FILE, key, 2)
    assert full.isfinite().all() and full.shape == (48, 2)

    def stop_after(b: int) -> None:
        if b == 3:
            raise Preempted

    path = tmp_path / "b" / FILE
    with pytest.raises(Preempted):
        precompute_reference_logps(*args, reference, engine, path, key, 2, after_batch=stop_after)
    calls = []

    def counted(batch):
        calls.append(int(batch.stage.pairs))
        return reference(batch)

    resumed = precompute_reference_logps(*args, counted, engine, path, key, 2)
    assert sum(calls) == 48 - 4 * 2  # four micro-batches of two pairs were scored before the preemption
    torch.testing.assert_close(resumed, full, rtol=0, atol=0)
    with pytest.raises(ConfigError, match=FILE):
        precompute_reference_logps(*args, reference, engine, path, "other data", 2)


def make_reference(cfg, source, layout, engine):
    """The stage's live reference forward (a frozen model of the starting weights), built as the run builds it."""
    from neva.parallel.precision import Precision
    from neva.training.dpo import live_reference

    precision = Precision.from_config(cfg.trainer.precision, cfg.model.megatron_amp_O2)
    return live_reference(engine, cfg, source, layout, precision, None, False)
