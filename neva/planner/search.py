"""Layout search: every layout of a run's model, stage and nodes that training accepts, planned, the fitting ones
ranked by predicted throughput (what NeMo's auto-configurator does, over the planner's model instead of trial runs).

The searched keys are training's own (``model.*``): tensor- and pipeline-parallel sizes, sequence parallelism, data
parallelism (DDP, FSDP2 ZeRO-2, ZeRO-3), expert parallelism (MoE models: powers of two dividing the experts; the
layout check keeps those that divide dp × cp), context parallelism (``context_parallel_sizes``: 1, 2, 4 and 8 where
they divide the world, when a row is long or the configured layout does not fit), activation checkpointing and the
micro-batch size. The global batch, the
precision, the model and the cluster stay as configured. A candidate is kept only if ``plan_run`` accepts it, i.e.
training's own checks pass (``Layout.from_config`` and every start-time rule, ``neva.parallel.run_rules.check_run``),
and only if its busiest rank fits in the GPU's memory.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from neva.checkpoint.architecture import neva_config_from_mm
from neva.config import ModelConfig, TrainConfig
from neva.planner.deployment import planned_gpus_per_node, planned_world
from neva.planner.images import image_load
from neva.planner.plan import Plan, plan_run
from neva.typed import ConfigError

# Context parallelism is searched (``context_parallel_sizes``) when a sample's row is at least ``LONG_ROW`` tokens or the
# configured layout does not fit: below that a row's activations are small beside the model state, and CP only adds its
# key/value all-gathers; above it (or when nothing else fits) it is the one key that divides the activations of a row.
CP_SIZES = (1, 2, 4, 8)
LONG_ROW = 8192

# model.* keys the search varies, in the order a candidate is built (and the CLI accepts as constraints).
SEARCHED = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "sequence_parallel",
    "data_parallel",
    "zero_stage",
    "expert_model_parallel_size",
    "context_parallel_size",
    "activations_checkpoint_granularity",
    "micro_batch_size",
)


@dataclass(frozen=True)
class SearchResult:
    """The ranked fitting plans and what was tried."""

    plans: list[Plan]  # fitting, fastest first
    tried: int  # candidate layouts built
    valid: int  # accepted by training's checks
    fitting: int  # valid and within the GPU memory


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def context_parallel_sizes(cfg: TrainConfig, configured: Plan | None) -> list[int]:
    """The CP sizes to search: ``CP_SIZES`` dividing the world, with the configured size, when the configured layout's
    plan (``configured``; None: training refuses it) does not fit or its row is at least ``LONG_ROW`` tokens; the
    configured size alone otherwise."""
    own = cfg.model.context_parallel_size
    if configured is not None and configured.fits and configured.seq_len < LONG_ROW:
        return [own]
    world = planned_world(cfg)
    return sorted({own, *(c for c in CP_SIZES if world % c == 0)})


def default_space(cfg: TrainConfig, num_layers: int, num_experts: int | None = None) -> dict[str, list[Any]]:
    """Candidate values of every searched key: TP within a node (its NVLink domain, as Megatron places it), PP up to
    the decoder's depth, the three data-parallel modes, no / selective / full checkpointing, micro-batches of powers
    of two up to the global batch; the configured virtual pipeline and context-parallel sizes (``search`` widens the
    latter, ``context_parallel_sizes``); EP sizes dividing ``num_experts`` (MoE)."""
    world, per_node = planned_world(cfg), planned_gpus_per_node(cfg)
    return {
        "tensor_model_parallel_size": _powers_of_two(per_node),
        "pipeline_model_parallel_size": [p for p in _powers_of_two(world) if p <= num_layers],
        "virtual_pipeline_model_parallel_size": [cfg.model.virtual_pipeline_model_parallel_size],
        "sequence_parallel": [False, True],
        "data_parallel": ["fsdp", "ddp"],
        "zero_stage": [3, 2],
        "expert_model_parallel_size": [e for e in _powers_of_two(world) if num_experts and num_experts % e == 0] or [1],
        # the configured size; ``search`` widens it for long rows (``context_parallel_sizes``)
        "context_parallel_size": [cfg.model.context_parallel_size],
        "activations_checkpoint_granularity": [None, "selective", "full"],
        "micro_batch_size": _powers_of_two(cfg.model.global_batch_size),
    }


def candidates(cfg: TrainConfig, space: dict[str, Sequence[Any]]) -> Iterator[TrainConfig]:
    """Configs of every combination of ``space`` (a value per ``SEARCHED`` key), without combinations that name the
    same layout twice (sequence parallelism without TP, a ZeRO stage under DDP, a virtual size without PP)."""
    seen = set()
    for values in itertools.product(*(space[k] for k in SEARCHED)):
        m = dict(zip(SEARCHED, values))
        if m["tensor_model_parallel_size"] == 1:
            m["sequence_parallel"] = False
        if m["data_parallel"] == "ddp":
            m["zero_stage"] = cfg.model.zero_stage
        if m["pipeline_model_parallel_size"] == 1:
            m["virtual_pipeline_model_parallel_size"] = None
        key = tuple(m.values())
        if key in seen:
            continue
        seen.add(key)
        model: ModelConfig = dataclasses.replace(cfg.model, **m)
        yield dataclasses.replace(cfg, model=model)


def search(
    cfg: TrainConfig,
    constraints: dict[str, Sequence[Any]] | None = None,
    top: int = 10,
    text_tokens: int | None = None,
    grad_reduce: str | None = None,
    image_size: tuple[int, int] | None = None,
    image_tokens: float | str | None = None,
    max_pixels: int | None = None,
    num_frames: int | None = None,
) -> SearchResult:
    """The ``top`` fastest layouts of ``cfg``'s model, stage, cluster and nodes that fit.

    Args:
        cfg: a composed config; its layout keys are the starting point, the searched ones are replaced.
        constraints: values some ``SEARCHED`` keys may take (the rest come from ``default_space``).
        top: how many plans to return (all fitting ones when <= 0).
        text_tokens / grad_reduce / image_size / image_tokens / max_pixels / num_frames: as ``plan_run``.

    Raises:
        ConfigError: a constraint names a key the search does not vary.
    """
    unknown = set(constraints or {}) - set(SEARCHED)
    if unknown:
        raise ConfigError(
            f"cannot constrain {sorted(unknown)} in a layout search; searched keys: {', '.join(SEARCHED)}"
        )
    model = neva_config_from_mm(cfg.model.mm_cfg, image_aspect_ratio=cfg.model.data.image_aspect_ratio)
    image_load(
        model, image_size, image_tokens, cfg.model.data, max_pixels
    )  # a bad image request fails here, not per layout
    plan = functools.partial(
        plan_run, text_tokens=text_tokens, grad_reduce=grad_reduce, model=model, num_frames=num_frames,
        image_size=image_size, image_tokens=image_tokens, max_pixels=max_pixels,
    )  # fmt: skip
    space = default_space(cfg, model.llm.num_layers, model.llm.num_moe_experts)
    if "context_parallel_size" not in (constraints or {}):
        try:
            configured = plan(cfg)
        except ConfigError:
            configured = None  # a layout training refuses does not fit either
        space["context_parallel_size"] = context_parallel_sizes(cfg, configured)
    space.update({k: list(v) for k, v in (constraints or {}).items()})
    tried = 0
    valid: list[Plan] = []
    for candidate in candidates(cfg, space):
        tried += 1
        try:
            valid.append(plan(candidate))
        except ConfigError:
            continue  # a layout training refuses (plan_run asks training's check_run): not a candidate
    fitting = [p for p in valid if p.fits]
    fitting.sort(key=lambda p: (-p.samples_per_s, p.peak.total))
    return SearchResult(fitting[:top] if top > 0 else fitting, tried, len(valid), len(fitting))
