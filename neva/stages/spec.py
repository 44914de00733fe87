"""What a training stage is, in one place: a spec that states the stage's facts and names its parts.

A stage (``+stage=<name>``, ``TrainConfig.stage``) says what it starts from, the planner's priors for its samples
(text tokens, the share learned, sequences per sample), whether it runs a reference model, and names its code parts:
the data module of its records, its objective, its rehearsal batch. Generic code asks ``neva.stages.stage_spec`` and
never a stage's name; a new stage is one spec file, one registry line and its ``configs/stage/<name>.yaml``
(docs/ARCHITECTURE.md, "Adding a stage").

As the family specs (``neva.families``), the spec sits below every package that uses it and names its code parts by
dotted path, resolved by the package that owns them (``neva.families.part``); ``tests/test_dependencies.py`` checks
each part lives there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Which package resolves each code part of a stage spec.
PART_OWNERS = {"data_module": "neva.training", "objective": "neva.training", "rehearsal_batches": "neva.training"}


@dataclass(frozen=True)
class StageSpec:
    """One training stage.

    Attributes:
        name: ``TrainConfig.stage`` (``+stage=<name>``).
        starts_from: the stage whose ``final`` it starts from when the run names no start (``model.restore_from_path``
            or HF weights), and how that stage's output is called in the refusal (``finetuned``); None: it may start
            from fresh weights.
        text_tokens: the planner's mean text tokens per sample (``plan.text_tokens`` overrides it).
        learned_fraction: the planner's share of a sample's text tokens that are learned (the LM head's positions).
        sequences_per_sample: decoder sequences one sample becomes (a preference pair: 2).
        reference: whether a run of this config runs a reference model's forward in training (the run's
            ``TrainConfig``; None: the stage never does).
        check: the stage's own start-time rule on the run's ``TrainConfig`` (raises ``ConfigError`` naming the key
            it cannot run with; ``neva.parallel.run_rules.check_run`` asks it first).
        data_module: ``(cfg) -> data module class`` of its records (``neva.training``), checking the settings the stage
            refuses first; None: conversations (``NevaDataModule``).
        objective: ``(cfg) -> HeadObjective`` replacing token cross-entropy (``neva.training``); None: token CE.
        rehearsal_batches: ``(cfg, sample, seq_length, layout) -> micro-batches`` of the plan's sample for the
            rehearsal (``neva.training``); None: the conversation collator's.
        rehearses_pipeline: the rehearsal can run the stage under pipeline parallelism.
    """

    name: str
    starts_from: tuple[str, str] | None = None
    text_tokens: int = 450
    learned_fraction: float = 0.5
    sequences_per_sample: int = 1
    reference: Callable[[Any], bool] | None = None
    check: Callable[[Any], None] | None = None
    data_module: str | None = None
    objective: str | None = None
    rehearsal_batches: str | None = None
    rehearses_pipeline: bool = True

    def parts(self) -> dict[str, str]:
        """The code parts this spec names, by field (what ``tests/test_dependencies.py`` checks)."""
        return {name: getattr(self, name) for name in PART_OWNERS if getattr(self, name)}
