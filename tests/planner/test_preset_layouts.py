"""Every preset ships the planner's fastest fitting layout (docs/PRESETS.md, "Layouts the planner chose"), and the
NeMo 13B presets scale to 16 nodes as NVIDIA's NeVA does (13.41× finetune, 14.26× pretrain)."""

from __future__ import annotations

from pathlib import Path

import pytest

from neva.config import CONFIG_DIR, compose_config
from neva.planner.preset_layout import DECIDED, fastest_layout, scaling

DOC = Path(__file__).resolve().parents[2] / "docs" / "PRESETS.md"
PRESETS = sorted(p.stem for p in (Path(CONFIG_DIR) / "preset").glob("*.yaml"))
# NVIDIA's 16-node speed-ups of the 13B NeVA, rounded down: what the NeMo presets must reproduce in the planner.
SEED_SCALING = {"nemo_llama2_13b_finetune": 13.0, "nemo_llama2_13b_pretrain": 14.0}


def doc_row(name: str) -> str:
    """The preset's row of the "Layouts the planner chose" table."""
    section = DOC.read_text().split("## Layouts the planner chose", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith(f"| `{name}` |")]
    assert len(rows) == 1, f"docs/PRESETS.md, 'Layouts the planner chose': no single row for {name}"
    return rows[0]


@pytest.mark.parametrize("name", PRESETS)
def test_preset_is_the_planners_fastest_fitting_layout(name):
    cfg = compose_config([f"+preset={name}"])
    choice, plan = fastest_layout(cfg)
    assert plan.fits
    assert {k: getattr(cfg.model, k) for k in DECIDED} == {k: choice[k] for k in DECIDED}
    row = doc_row(name)
    assert f"→ {plan.samples_per_s:.1f} |" in row
    # a faster layout with another micro-batch is a stated deviation: its figure is in the row
    free, free_plan = fastest_layout(cfg, keep_micro_batch=False)
    if free != choice:
        assert f"mbs {free['micro_batch_size']}: {free_plan.samples_per_s:.1f}" in row
    else:
        assert row.endswith("| the same |")


@pytest.mark.parametrize("name", sorted(SEED_SCALING))
def test_nemo_13b_presets_scale_like_nvidias_neva(name):
    got = scaling(compose_config([f"+preset={name}"]))
    assert got.base == 1 and got.nodes == 16
    assert got.speedup >= SEED_SCALING[name]
    assert "1 → 16: " in doc_row(name) and f"→ {got.speedup:.2f}× |" in doc_row(name)
