"""The performance model reproduces NVIDIA's published NeVA 13B scaling (docs/PLANNER.md, error table)."""

from __future__ import annotations

import pytest

from neva.planner.calibration import calibration_table, h100_ratios, predict

TOLERANCE = 0.10


@pytest.fixture(scope="module")
def rows():
    return calibration_table()


def test_speedups_within_tolerance(rows) -> None:
    bad = [(r.stage, r.cluster, r.nodes, round(r.speedup_error, 3)) for r in rows if abs(r.speedup_error) > TOLERANCE]
    assert not bad, f"speedup errors above {TOLERANCE:.0%}: {bad}"


def test_h100_over_a100_ratios_within_tolerance(rows) -> None:
    for stage, nodes, pred, pub in h100_ratios(rows):
        assert abs(pred / pub - 1) <= TOLERANCE, (stage, nodes, pred, pub)
        assert 1.8 <= pred <= 2.2


def test_absolute_throughput_within_tolerance(rows) -> None:
    for r in rows:
        assert abs(r.predicted_samples_per_s / r.published_samples_per_s - 1) <= 0.20, r


def test_flops_per_sample_match_references() -> None:
    """REFERENCES.md: 13B pretrain ≈ 18.5 TFLOP/sample at ~350 tokens (we pad to 384); MFU on H100 ≈ 18%."""
    plan = predict("pretrain", "dgx_h100")[0]
    assert plan.seq_len == 384
    assert 19e12 < plan.flops_per_sample < 21.5e12
    assert 0.15 < plan.mfu < 0.22
