"""neva's side of both benchmark modes, built the way training builds it (``NevaModule.configure_model``).

The stage config is composed from the same Hydra files as ``python -m neva.train +stage=...`` (its trainable policy,
precision, packing, optimizer, compute plans); only the architecture is the benchmark's own. The model is built on
the meta device with the stage's policy (after the run's start-time rules, ``check_run``), then ``parallelize``
materialises it (one process) and ``Engine`` runs the step: no freezing, casting or master weights of the
benchmark's own.
"""

from __future__ import annotations

from typing import Any

import torch

from neva.checkpoint.source import ModelSource
from neva.config import TrainConfig, compose_config
from neva.models.config import NevaConfig
from neva.models.flops import SampleFlops
from neva.parallel.layout import Layout
from neva.parallel.parallelize import parallelize
from neva.parallel.precision import Precision
from neva.training.engine import Engine
from neva.training.start_checks import checked_meta_model


def stage_config(stage: str, *overrides: str) -> TrainConfig:
    """The composed, validated config of ``+stage=<stage>`` with ``overrides`` (training's command-line syntax)."""
    return compose_config([f"+stage={stage}", *overrides])


def build_engine(model_cfg: NevaConfig, cfg: TrainConfig, device: torch.device) -> tuple[Engine, SampleFlops]:
    """A one-process engine for ``model_cfg`` trained as ``cfg`` says, freshly initialised from ``model.seed``, and
    the FLOP counts of the model it runs."""
    precision = Precision.from_config(cfg.trainer.precision, cfg.model.megatron_amp_O2)
    layout = Layout.from_config(cfg.model, world=1, device_type=device.type)
    model = checked_meta_model(cfg, model_cfg, layout)  # training's start: check_run, then the meta model
    flops = SampleFlops.of(model)
    parallel = parallelize(model, ModelSource(model_cfg, tokenizer=None), layout, cfg.model, device, precision)
    engine = Engine(
        parallel, precision, device, packed=cfg.model.data.packing, loss_normalization=cfg.model.loss_normalization
    )
    return engine, flops


def step_flops(flops: SampleFlops, samples: list[dict[str, Any]]) -> float:
    """Model FLOPs of training on ``samples`` (uncollated: their own lengths, padding excluded)."""
    images = sum(int(s["pixel_values"].shape[0]) for s in samples)
    return flops.batch([int(s["input_ids"].numel()) for s in samples], images)
