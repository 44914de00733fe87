"""The run's layout: how many processes, how the model is split over them, and this process's place.

One type for training, the planner (which adds cluster facts around it) and the benchmark. world = pp × dp × cp × tp;
the mesh is ``("pp", "dp", "cp", "tp")`` with tp fastest, so a TP group stays inside a node (NVLink), the context-
parallel ranks of one sequence (whose keys and values are gathered in every layer) sit next to it, and only pipeline
point-to-point traffic crosses the slower links.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from neva.config import ModelConfig, TrainConfig
from neva.typed import ConfigError


@dataclass(frozen=True)
class Layout:
    """Sizes and enabled plans of a run (``model.*`` parallel keys, validated), plus this process's coordinates.

    Attributes:
        tp / pp / dp: tensor-, pipeline- and data-parallel sizes.
        vpp: virtual pipeline chunks per pipeline rank.
        schedule: the pipeline schedule actually run (a virtual size selects ``interleaved_1f1b``, as in NeMo).
        sp: sequence parallelism in effect (requested and tp > 1).
        data_parallel: ``fsdp`` or ``ddp``; zero_stage: FSDP2's 3 (reshard after forward) or 2.
        first_stage_layers: decoder layers on the first pipeline chunk (it also runs vision), None = even split.
        ac / ac_num_layers: activation checkpointing granularity and how many blocks per chunk (None = all).
        micro_batch_size / global_batch_size: samples per micro-batch and per optimizer step.
        device_type: ``cuda`` (one GPU per process, NCCL) or ``cpu`` (gloo).
        dp_rank: this process's data-parallel rank.
        ep: expert-parallel size (MoE experts split over groups of ``ep`` consecutive data-parallel ranks, of
            dp × cp under context parallelism; the ``dp · cp / ep`` groups hold replicas of them), carved from them
            as Megatron-Core does.
        cp: context-parallel size: each sequence of a micro-batch split over ``cp`` ranks, which read the same
            micro-batches (``neva.parallel.context_parallel``); gradients are reduced over dp × cp.
        fsdp_offload / activation_offload: ``model.fsdp_offload`` (FSDP2's CPU offload: sharded state in host memory)
            and ``model.activation_offload`` (saved activations in host memory).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    schedule: str = "1f1b"
    sp: bool = False
    data_parallel: str = "fsdp"
    zero_stage: int = 3
    first_stage_layers: int | None = None
    ac: str | None = None
    ac_num_layers: int | None = None
    micro_batch_size: int = 1
    global_batch_size: int = 1
    device_type: str = "cpu"
    dp_rank: int = 0
    ep: int = 1
    cp: int = 1
    fsdp_offload: bool = False
    activation_offload: bool = False

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def dp_cp(self) -> int:
        """Ranks over which gradients are reduced (and FSDP2 shards): data- × context-parallel."""
        return self.dp * self.cp

    @property
    def is_distributed(self) -> bool:
        """Runs under a process group: more than one rank, or FSDP2's CPU offload (on one rank too: FSDP2 needs
        one)."""
        return self.world > 1 or self.fsdp_offload

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    @property
    def num_chunks(self) -> int:
        """Pipeline chunks of the decoder (pp × vpp)."""
        return self.pp * self.vpp

    @property
    def grad_accum(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def sharded(self) -> bool:
        """Parameters, gradients and optimizer state are sharded over dp × cp at rest (FSDP2, ZeRO-2 or ZeRO-3)."""
        return self.data_parallel == "fsdp" and self.dp_cp > 1

    @classmethod
    def from_config(cls, m: ModelConfig, world: int, device_type: str = "cpu", dp_rank: int = 0) -> Layout:
        """The layout ``model.*`` asks for on ``world`` processes.

        Raises:
            ConfigError: ``tp × pp × cp`` does not divide the world, the global batch does not divide into
                micro-batches × dp, or a pipeline option is set without pipeline parallelism.
        """
        tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
        if cp < 1:
            raise ConfigError(f"model.context_parallel_size={cp} must be at least 1")
        if world % (tp * pp * cp):
            raise ConfigError(
                f"world size {world} is not divisible by model.tensor_model_parallel_size ({tp}) × "
                f"model.pipeline_model_parallel_size ({pp}) × model.context_parallel_size ({cp}); choose sizes whose "
                "product divides the number of processes"
            )
        dp = world // (tp * pp * cp)
        per_step = m.micro_batch_size * dp
        if m.global_batch_size % per_step:
            raise ConfigError(
                f"model.global_batch_size={m.global_batch_size} is not a multiple of "
                f"model.micro_batch_size ({m.micro_batch_size}) × data-parallel size ({dp}) = {per_step}"
            )
        vpp = m.virtual_pipeline_model_parallel_size or 1
        if vpp > 1 and pp == 1:
            raise ConfigError("model.virtual_pipeline_model_parallel_size needs model.pipeline_model_parallel_size > 1")
        if pp == 1 and m.pipeline_schedule == "interleaved_1f1b":
            raise ConfigError("model.pipeline_schedule=interleaved_1f1b needs model.pipeline_model_parallel_size > 1")
        ep = m.expert_model_parallel_size
        if ep < 1 or (dp * cp) % ep:
            ranks = f"data-parallel size {dp}" if cp == 1 else f"data- × context-parallel size {dp} × {cp}"
            raise ConfigError(
                f"model.expert_model_parallel_size={ep} must divide the {ranks} (experts are split over the ranks "
                "that hold different tokens)"
            )
        schedule = "interleaved_1f1b" if vpp > 1 and m.pipeline_schedule == "1f1b" else m.pipeline_schedule
        return cls(
            tp=tp,
            pp=pp,
            dp=dp,
            vpp=vpp,
            schedule=schedule,
            sp=m.sequence_parallel and tp > 1,
            data_parallel=m.data_parallel,
            zero_stage=m.zero_stage,
            first_stage_layers=m.pipeline_first_stage_layers,
            ac=m.activations_checkpoint_granularity,
            ac_num_layers=m.activations_checkpoint_num_layers,
            micro_batch_size=m.micro_batch_size,
            global_batch_size=m.global_batch_size,
            device_type=device_type,
            dp_rank=dp_rank,
            ep=ep,
            cp=cp,
            fsdp_offload=m.fsdp_offload,
            activation_offload=m.activation_offload,
        )


def device_type(cfg: TrainConfig) -> str:
    """``cuda`` when ``trainer.accelerator`` allows it and a GPU is visible, else ``cpu``.

    Raises:
        ConfigError: a GPU was asked for and none is visible.
    """
    accel = cfg.trainer.accelerator
    if accel == "cpu":
        return "cpu"
    if accel in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError("trainer.accelerator=gpu but no CUDA device is visible")
    return "cuda" if torch.cuda.is_available() else "cpu"


def world_size(cfg: TrainConfig) -> int:
    """Processes in the run: torchrun's ``WORLD_SIZE``, SLURM's ``SLURM_NTASKS``, else devices × nodes.

    The last case is Lightning's own launcher (``trainer.devices=N``): the main process starts before the others
    exist, so the size comes from the config.
    """
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if var in os.environ:
            return int(os.environ[var])
    devices = cfg.trainer.devices
    if devices == "auto":
        per_node = torch.cuda.device_count() if torch.cuda.is_available() and cfg.trainer.accelerator != "cpu" else 1
    elif isinstance(devices, (list, tuple)):
        per_node = len(devices)
    else:
        per_node = int(devices)
    return max(1, per_node) * cfg.trainer.num_nodes


def global_rank(per_node: int = 1) -> int:
    """This process's rank as the launcher tells it (0 for the main process of Lightning's launcher)."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if "SLURM_PROCID" in os.environ:
        return int(os.environ["SLURM_PROCID"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    node = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or per_node
    return node * per_node + local


def mesh_coords(rank: int, layout: Layout) -> tuple[int, int, int, int]:
    """``(pp, dp, cp, tp)`` coordinates of ``rank`` in the row-major mesh ``("pp", "dp", "cp", "tp")`` (tp
    fastest)."""
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    return rank // (dp * cp * tp), (rank // (cp * tp)) % dp, (rank // tp) % cp, rank % tp


def resolve_layout(cfg: TrainConfig) -> Layout:
    """This process's layout: the world from the launcher, the device from the config and what is visible."""
    world = world_size(cfg)
    layout = Layout.from_config(cfg.model, world, device_type(cfg))
    if world == 1:
        return layout
    _, dp_rank, _, _ = mesh_coords(global_rank(world // cfg.trainer.num_nodes), layout)
    return Layout.from_config(cfg.model, world, layout.device_type, dp_rank)
