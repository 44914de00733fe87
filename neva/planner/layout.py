"""The parallel layout and precision of a run, as the planner sees it (derived from a composed ``TrainConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from neva.config import TrainConfig
from neva.typed import ConfigError

# Lightning precision strings that mean "bf16/fp16 compute"; with megatron_amp_O2 they give bf16 params + fp32 master.
_LOW_PRECISION = ("bf16", "bf16-mixed", "bf16-true", "16", "16-mixed", "16-true")
# Without O2, these keep fp32 parameters and autocast the compute (Lightning's "-mixed").
_MIXED = ("bf16-mixed", "16-mixed", "32", "32-true")


@dataclass(frozen=True)
class Layout:
    """World = pp × dp × tp ranks on ``nodes`` nodes (mesh dims ``("pp", "dp", "tp")``, tp innermost).

    Attributes:
        precision: ``o2`` (bf16 params + fp32 master/grads/Adam), ``fp32`` (fp32 params, grads, Adam; also
            autocast ``bf16-mixed`` whose compute is bf16 but storage fp32) or ``bf16`` (everything bf16).
        compute_bytes: bytes per element of activations and TP/PP messages.
        ac: activation checkpointing: None, ``full`` or ``selective``.
        grad_reduce: dtype of data-parallel gradient reduction, ``fp32`` (neva's O2: FSDP2 ``reduce_dtype`` fp32)
            or ``bf16`` (Megatron-core's default, ``grad_reduce_in_fp32=False``).
    """

    nodes: int
    gpus_per_node: int
    tp: int
    pp: int
    dp: int
    vpp: int
    schedule: str
    sp: bool
    data_parallel: str  # fsdp | ddp
    zero_stage: int
    precision: str
    compute_bytes: int
    ac: str | None
    ac_num_layers: int | None
    micro_batch_size: int
    global_batch_size: int
    first_stage_layers: int | None
    grad_reduce: str = "fp32"

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def grad_accum(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def sharded(self) -> bool:
        """Parameters, gradients and optimizer state are sharded over dp at rest (FSDP2, ZeRO-2 or ZeRO-3)."""
        return self.data_parallel == "fsdp" and self.dp > 1


def layout_from_config(
    cfg: TrainConfig, global_batch_size: int | None = None, grad_reduce: str | None = None
) -> Layout:
    """The layout ``cfg`` describes; ``global_batch_size`` overrides the config's (weak-scaling sweeps) and
    ``grad_reduce`` the gradient-reduction dtype (default: bf16 for pure-bf16 runs, else fp32).

    Raises:
        ConfigError: the world does not divide into tp × pp, or the global batch into micro-batches × dp.
    """
    m = cfg.model
    devices = cfg.trainer.devices if isinstance(cfg.trainer.devices, int) else cfg.cluster.gpus_per_node
    world = cfg.trainer.num_nodes * devices
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    if world % (tp * pp):
        raise ConfigError(f"world size {world} is not divisible by tp {tp} × pp {pp}")
    dp = world // (tp * pp)
    gbs = global_batch_size or m.global_batch_size
    if gbs % (m.micro_batch_size * dp):
        raise ConfigError(
            f"global_batch_size {gbs} is not a multiple of micro_batch_size {m.micro_batch_size} × dp {dp}"
        )
    if grad_reduce not in (None, "fp32", "bf16"):
        raise ConfigError(f"grad_reduce must be fp32 or bf16, got {grad_reduce!r}")
    precision = str(cfg.trainer.precision)
    if m.megatron_amp_O2 and precision in _LOW_PRECISION:
        kind, compute = "o2", 2
    elif precision in _MIXED:
        kind, compute = "fp32", 2 if precision in ("bf16-mixed", "16-mixed") else 4
    else:
        kind, compute = "bf16", 2
    return Layout(
        nodes=cfg.trainer.num_nodes,
        gpus_per_node=devices,
        tp=tp,
        pp=pp,
        dp=dp,
        vpp=m.virtual_pipeline_model_parallel_size or 1,
        schedule=m.pipeline_schedule,
        sp=m.sequence_parallel and tp > 1,
        data_parallel=m.data_parallel,
        zero_stage=m.zero_stage,
        precision=kind,
        compute_bytes=compute,
        ac=m.activations_checkpoint_granularity,
        ac_num_layers=m.activations_checkpoint_num_layers,
        micro_batch_size=m.micro_batch_size,
        global_batch_size=gbs,
        first_stage_layers=m.pipeline_first_stage_layers,
        grad_reduce=grad_reduce or ("bf16" if kind == "bf16" else "fp32"),
    )
