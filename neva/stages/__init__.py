"""The registry of training stages: one line per stage (docs/ARCHITECTURE.md, "Adding a stage")."""

from __future__ import annotations

from neva.stages.dpo import DPO
from neva.stages.finetune import FINETUNE
from neva.stages.pretrain import PRETRAIN
from neva.stages.spec import StageSpec

STAGES: dict[str, StageSpec] = {spec.name: spec for spec in (PRETRAIN, FINETUNE, DPO)}

__all__ = ["STAGES", "StageSpec", "stage_spec"]


def stage_spec(name: str) -> StageSpec:
    """The stage ``name``.

    Raises:
        ValueError: a stage neva has no spec for, naming the known ones.
    """
    try:
        return STAGES[name]
    except KeyError:
        raise ValueError(f"stage must be one of {tuple(STAGES)}, got {name!r}") from None
