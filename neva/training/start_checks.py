"""Training's start: the run's meta model, once every start-time rule of the run has passed.

``NevaModule.configure_model`` and the full-size rehearsal both start here, so training and its pre-flight refuse
the same runs, with the messages of ``neva.parallel.run_rules.check_run`` (which the planner and the support matrix
ask too).
"""

from __future__ import annotations

from typing import Any

from neva.config import TrainConfig
from neva.models.config import NevaConfig
from neva.models.neva import NevaModel
from neva.models.trainable import build_meta_model
from neva.parallel.layout import Layout
from neva.parallel.precision import Precision
from neva.parallel.run_rules import check_run


def check_start(cfg: TrainConfig, layout: Layout, model: NevaModel, head: Any = None) -> None:
    """``check_run`` of the run as training runs it: ``cfg``'s stage and settings, ``layout``, the meta ``model``,
    training's precision policy and ``head`` (the run's head objective; None: token cross-entropy).

    Raises:
        ConfigError: the first start-time rule the run breaks.
    """
    check_run(cfg, layout, model, Precision.from_config(cfg.trainer.precision, cfg.model.megatron_amp_O2), head)


def checked_meta_model(cfg: TrainConfig, arch: NevaConfig, layout: Layout, head: Any = None) -> NevaModel:
    """``arch`` on the meta device with the stage's freezing and LoRA (``build_meta_model``), once ``check_start``
    has passed.

    Raises:
        ConfigError: the first start-time rule the run breaks.
    """
    model = build_meta_model(arch, cfg.model.trainable_policy())
    check_start(cfg, layout, model, head)
    return model
