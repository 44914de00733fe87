"""One construction of a run, used by training (``NevaModule.configure_model``) and by the full-size rehearsal:
the stage's objective, the meta model once every start-time rule has passed (``start_checks``), its parallel parts
(``parallelize``, the same for every world size), then the ``Engine`` over them with the objective's reference.

Two steps, because the rehearsal allocates the parts under its fake allocation and builds the engine inside its fake
mode, with work of its own between (the micro-batches split on host tensors, MoE's uniform routing); training runs
them back to back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from neva.checkpoint.source import ModelSource
from neva.config import ModelConfig, TrainConfig
from neva.models.neva import NevaModel
from neva.parallel.layout import Layout
from neva.parallel.parallelize import ParallelModel, parallelize
from neva.parallel.precision import Precision
from neva.training.engine import Engine
from neva.training.objectives import stage_objective
from neva.training.start_checks import checked_meta_model


@dataclass
class Parts:
    """A run's model before its engine: the meta model (FLOPs, parameter counts), this rank's parallel parts, the
    stage's objective (None: token cross-entropy) and the model settings the parts were built with."""

    model: NevaModel
    parallel: ParallelModel
    objective: Any
    settings: ModelConfig


def build_parts(
    cfg: TrainConfig,
    source: ModelSource,
    layout: Layout,
    device: torch.device,
    precision: Precision,
    dims: Any,
    settings: ModelConfig | None = None,
    allocation: Any = None,
) -> Parts:
    """The stage's objective, the checked meta model of ``source``'s architecture and this rank's parts of it.

    ``settings``: the model settings to build with where they differ from ``cfg.model`` (the rehearsal's meta-init,
    unpacked rows); the start-time rules are always the run's as configured. ``allocation``: ``parallelize``'s.

    Raises:
        ConfigError: the first start-time rule the run breaks.
    """
    objective = stage_objective(cfg)
    model = checked_meta_model(cfg, source.cfg, layout, objective)
    settings = settings or cfg.model
    parallel = parallelize(model, source, layout, settings, device, precision, dims, allocation=allocation)
    return Parts(model, parallel, objective, settings)


def build_engine(
    parts: Parts,
    cfg: TrainConfig,
    source: ModelSource,
    layout: Layout,
    device: torch.device,
    precision: Precision,
    data: Any = None,
    frozen: ParallelModel | None = None,
) -> Engine:
    """The engine over ``parts``, the stage's objective as its head and auxiliary objective, and the objective's
    reference attached (``data``: the run's data module, for a reference computed once before training; ``frozen``:
    a frozen reference built by the caller, the rehearsal's under its fake allocation)."""
    settings, objective = parts.settings, parts.objective
    engine = Engine(
        parts.parallel,
        precision,
        device,
        packed=settings.data.packing,
        loss_normalization=settings.loss_normalization,
        head=objective,
        objectives=(objective,) if objective is not None else (),
    )
    if objective is not None:
        run_cfg = dataclasses.replace(cfg, model=settings)
        objective.attach_reference(
            engine, run_cfg, source, layout, precision, parts.parallel.dims, data=data, frozen=frozen
        )
    return engine
