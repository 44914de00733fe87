"""The preference stage (``stage=dpo``) in the planner: a sample is a pair of sequences, and a reference model runs.

A pair's chosen and rejected replies are two rows of one concatenated micro-batch (``neva.data.preference``), so the
stage is planned as a run of sequences: micro-batch and global batch twice the pairs (activations, FLOPs, the step's
communication), samples per second then pairs. The reference (``neva.training.dpo``) adds per sequence the forward of
a fully frozen model (no backward), and its weights where it is a frozen copy of the starting weights, FSDP2-sharded
over the data-parallel ranks whatever the run's ``data_parallel`` (``frozen_reference``); none under LoRA (the trained
model with its adapters off) or with ``model.dpo.precompute_ref_log_probs`` (no reference in training).
"""

from __future__ import annotations

import dataclasses

from neva.config import TrainConfig
from neva.planner.deployment import Deployment
from neva.planner.memory import rank_state_bytes
from neva.planner.params import ParamInfo
from neva.stages import stage_spec


def sequences_per_sample(cfg: TrainConfig) -> int:
    """Sequences one sample of the run's stage puts through the model (its spec's ``sequences_per_sample``)."""
    return stage_spec(cfg.stage).sequences_per_sample


def sequence_deployment(dep: Deployment, sequences: int) -> Deployment:
    """``dep`` with its micro-batch and global batch counted in sequences (same micro-batches per step)."""
    layout = dep.layout
    return dataclasses.replace(
        dep,
        layout=dataclasses.replace(
            layout,
            micro_batch_size=layout.micro_batch_size * sequences,
            global_batch_size=layout.global_batch_size * sequences,
        ),
    )


def frozen_inventory(infos: list[ParamInfo]) -> list[ParamInfo]:
    """The same parameters, none trained (the reference: its FLOPs are forward only)."""
    return [dataclasses.replace(p, trainable=False) for p in infos]


def reference_bytes(infos: list[ParamInfo], dep: Deployment, stage: int, layers: list[list[int]]) -> int:
    """The frozen reference copy's weights on the busiest rank of ``stage``: FSDP2-sharded over dp like training's
    (``data_parallel=fsdp``), cut into the run's pipeline stages and TP shards."""
    ref = dataclasses.replace(dep, layout=dataclasses.replace(dep.layout, data_parallel="fsdp"))
    return rank_state_bytes(frozen_inventory(infos), ref, stage, layers).params
