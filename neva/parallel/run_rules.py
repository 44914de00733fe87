"""Every start-time rule of a run, in one list: ``check_run``.

A run is a layout × a model (with its stage's freezing and LoRA) × a stage × a precision × data settings. Before the
first step training asks ``check_run`` (``neva.training.start``, from ``NevaModule.configure_model``; the full-size
rehearsal too), and so do the planner (``plan_run``, hence its layout search and the start-of-run forecast) and the
support matrix (``neva.support``): the four give one verdict, with one message, on the same run
(``tests/parallel/test_run_rules.py`` walks the support matrix's cells through them). A rule is written once, in the module of
the mechanism it protects (``tensor_parallel.check_tensor_parallel``, ``pipeline.check_microbatches``, ...); this
file is the one place that lists them, in the order a run meets them, and takes each one's inputs from the same
facts. The mechanisms may still guard their own preconditions with the same functions (``apply_tensor_parallel``,
``build_chunks``, ``PipelineRunner``), never with a rule of their own.

``Layout.from_config`` (sizes that divide the world and the batch, pipeline options without PP, EP over dp × cp) is
the layout's own validation, which every caller runs to have a layout at all; it is not repeated here.
"""

from __future__ import annotations

from typing import Any

from neva.config import TrainConfig
from neva.models.neva import NevaModel
from neva.parallel.context_parallel import check_context_parallel_model, check_context_parallel_objective
from neva.parallel.expert_parallel import check_expert_parallel_layout
from neva.parallel.generation_model import check_generation_layout
from neva.parallel.layout import Layout
from neva.parallel.parallelize import check_offload_layout, check_precision_layout
from neva.parallel.pipeline import (
    check_deepstack_split,
    check_interleaved,
    check_microbatches,
    check_splittable,
    split_layers,
)
from neva.parallel.precision import Precision
from neva.parallel.tensor_parallel import check_tensor_parallel
from neva.stages import stage_spec
from neva.typed import ConfigError


def check_stage(cfg: TrainConfig) -> None:
    """The stage's own settings (its spec's ``check``: DPO's refused keys; the other stages refuse nothing).
    Training also asks it before the data is read (``neva.training.run.data_module_type``)."""
    check = stage_spec(cfg.stage).check
    if check is not None:
        check(cfg)


def check_trainable(model: NevaModel) -> None:
    """Raises: ConfigError when the stage's freezing and LoRA leave nothing to train."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("no trainable parameters: check model.mm_cfg.*.freeze and model.peft")


def check_run(cfg: TrainConfig, layout: Layout, model: NevaModel, precision: Precision, head: Any = None) -> None:
    """Every start-time rule of the run, in the order training meets them; the first that fails raises.

    Args:
        cfg: the run's config: its stage, ``model.loss_normalization`` and data settings (the layout keys are read
            from ``layout``, which may differ from ``cfg.model``'s: the planner's weak-scaling batch, a search's
            candidate).
        layout: the run's layout (``Layout.from_config``).
        model: the whole model on the meta device with the stage's freezing and LoRA applied
            (``neva.models.trainable.build_meta_model``; the planner's memoised one).
        precision: what the run computes in; only ``master_weights`` (O2) is read, so the planner's fp16 plans
            (which training does not run) pass their O2 flag.
        head: the run's head objective (``neva.training.objectives.HeadObjective``), None for the stage's own (token
            cross-entropy, the preference objective: both computed on a context-parallel shard).

    Raises:
        ConfigError: the first rule the run breaks, naming the keys.
    """
    check_stage(cfg)
    check_trainable(model)
    check_precision_layout(layout, precision)
    check_offload_layout(cfg.model.fsdp_offload, layout, precision)
    check_splittable(model.cfg, layout.pp)
    check_deepstack_split(
        model.cfg, split_layers(model.cfg.llm.num_layers, layout.num_chunks, layout.first_stage_layers)
    )
    check_microbatches(layout.schedule, layout.pp, layout.grad_accum)
    check_interleaved(layout.schedule, layout.pp, layout.vpp)
    check_expert_parallel_layout(layout, model.cfg.llm)
    if layout.tp > 1:
        check_tensor_parallel(model, layout.tp)
    check_context_parallel_model(layout, model.cfg.llm)
    if stage_spec(cfg.stage).rollout is not None:  # the stage generates on the training model (its rollouts)
        check_generation_layout(model.cfg, layout)
    refused_head = None if head is None or head.context_parallel else type(head).__name__
    check_context_parallel_objective(layout, cfg.model.loss_normalization, refused_head)
