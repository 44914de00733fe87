"""Hardware of a cluster preset plus the efficiency constants of the performance model.

The constants are fractions of datasheet peaks (or achieved rates) that real kernels and collectives reach. Defaults
live here; a cluster YAML overrides any of them in its ``efficiency:`` dict (``cluster.efficiency.compute=0.3`` on the
command line works too). docs/PLANNER.md explains each and how the DGX values were calibrated.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from neva.config import ClusterConfig
from neva.models.flops import device_peak_tflops
from neva.typed import ConfigError


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions / rates (see docs/PLANNER.md, "Efficiency constants").

    Attributes:
        compute: fraction of the bf16 peak the step's compute reaches (matmuls plus the memory-bound kernels
            around them, whose share grows on faster GPUs).
        nvlink: fraction of the per-direction NVLink bandwidth (half of ``nvlink_gb_per_s``) an NCCL ring reaches.
        ib: fraction of the per-GPU InfiniBand rail (``ib_gb_per_s / gpus_per_node``) an NCCL ring reaches.
        latency_us: fixed cost of one collective or point-to-point message.
        dp_overlap: largest fraction of data-parallel communication hidden behind compute.
        jitter_cv: coefficient of variation of one data-parallel replica's step time (sample lengths, data
            loading, OS noise); the step waits for the slowest replica.
        optimizer_gb_per_s: memory throughput of the optimizer step (reads/writes params, grads, Adam states).
        memory_overhead_gb: per-GPU memory beyond the model's tensors (CUDA context, NCCL buffers, fragmentation).
        pcie_gb_per_s: host ↔ device copy bandwidth per GPU, each direction (offload; PCIe Gen4 x16 reaches about
            25 GB/s from page-locked memory, Gen5 about 50: uncalibrated, set it for the machine).
        host_optimizer_gb_per_s: memory throughput of AdamW stepping on the host (``model.fsdp_offload``; torch's
            fused CPU kernel over the rank's cores, uncalibrated).
        offload_overlap: largest fraction of the offload copies hidden behind compute (they are asynchronous from
            page-locked memory; uncalibrated).
    """

    compute: float = 0.35
    nvlink: float = 0.75
    ib: float = 0.8
    latency_us: float = 20.0
    dp_overlap: float = 0.85
    jitter_cv: float = 0.05
    optimizer_gb_per_s: float = 1500.0
    memory_overhead_gb: float = 3.0
    pcie_gb_per_s: float = 25.0
    host_optimizer_gb_per_s: float = 20.0
    offload_overlap: float = 0.5


@dataclass(frozen=True)
class Hardware:
    """One cluster: per-GPU peaks and links (bytes/s), plus the efficiency constants."""

    name: str
    gpus_per_node: int
    gpu_memory_gb: float
    peak_flops: float
    nvlink_bytes_per_s: float  # per direction, per GPU
    ib_bytes_per_s: float  # per GPU rail
    eff: Efficiency


def hardware_from_config(cluster: ClusterConfig) -> Hardware:
    """The cluster preset as the planner uses it.

    Raises:
        ConfigError: no peak FLOP/s (the ``local`` preset: unknown GPU) or an unknown efficiency key.
    """
    peak = device_peak_tflops(cluster.gpu_name, cluster.peak_tflops_bf16)
    if not peak:
        raise ConfigError(
            f"cluster {cluster.name!r}: no bf16 peak for gpu_name {cluster.gpu_name!r}; choose cluster=dgx_a100 or "
            "dgx_h100, or set cluster.peak_tflops_bf16"
        )
    known = {f.name for f in fields(Efficiency)}
    unknown = set(cluster.efficiency) - known
    if unknown:
        raise ConfigError(f"cluster.efficiency has unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    eff = Efficiency(**{k: float(v) for k, v in cluster.efficiency.items()})
    return Hardware(
        name=cluster.name,
        gpus_per_node=cluster.gpus_per_node,
        gpu_memory_gb=cluster.gpu_memory_gb,
        peak_flops=peak * 1e12,
        # The datasheet NVLink figure counts both directions; a ring sends one way per link.
        nvlink_bytes_per_s=cluster.nvlink_gb_per_s * 1e9 / 2,
        ib_bytes_per_s=cluster.ib_gb_per_s * 1e9 / cluster.gpus_per_node,
        eff=eff,
    )
