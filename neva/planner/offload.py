"""What the offload knobs move off the device, and what they cost on the bus (``model.fsdp_offload``,
``model.activation_offload``; training's side: ``neva.parallel.data_parallel``, ``neva.parallel.activation_offload``).

- FSDP2's CPU offload keeps every sharded tensor in host memory: the parameters at rest (O2: the fp32 masters), their
  reduced gradient shards and AdamW's states. The device holds none of them at rest; what it still holds is what
  FSDP2 unshards or accumulates on it (the working buffers, the unsharded gradients accumulated over micro-batches)
  and one group's shard copied over for its all-gather. Per micro-batch every group's shard crosses the bus for its
  forward all-gather and again for its backward one (ZeRO-3; ZeRO-2 keeps the forward's), the gradient shards cross
  back once per step, and AdamW steps on the host.
- Activation offload keeps what each decoder block saves for backward in host memory: the device keeps one block's
  worth (the block being run), the host the rest; each saved byte crosses the bus twice per micro-batch.

Copies are asynchronous from page-locked memory: ``Efficiency.offload_overlap`` of them hides behind compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from neva.planner.deployment import Deployment
from neva.planner.hardware import Hardware
from neva.planner.memory import StateBytes


@dataclass(frozen=True)
class Offload:
    """One stage's busiest rank under the offload knobs: bytes moved to the host, bus bytes and seconds per step."""

    host: float = 0.0  # bytes resident in host memory
    bus_bytes: float = 0.0  # host <-> device bytes per optimizer step
    host_optimizer_s: float = 0.0  # AdamW on the host


def state_offload(state: StateBytes, dep: Deployment) -> tuple[StateBytes, float]:
    """(the device's share of ``state``, the bytes ``model.fsdp_offload`` moves to the host)."""
    if not dep.layout.fsdp_offload:
        return state, 0.0
    return StateBytes(0, 0, 0), float(state.params + state.grads + state.optimizer)


def state_bus_bytes(state: StateBytes, dep: Deployment) -> float:
    """Bus bytes per step of FSDP2's CPU offload: every shard to the device for each all-gather of each micro-batch
    (forward and, under ZeRO-3, backward), the gradient shards back once."""
    if not dep.layout.fsdp_offload:
        return 0.0
    gathers = 2 if dep.layout.zero_stage == 3 else 1
    return float(state.params) * gathers * dep.layout.grad_accum + float(state.grads)


def host_optimizer_seconds(trained_elements: float, dep: Deployment, hw: Hardware) -> float:
    """AdamW over the rank's trained shards on the host (30 bytes read or written per element, as on the device)."""
    if not dep.layout.fsdp_offload:
        return 0.0
    return trained_elements * 30 / (hw.eff.host_optimizer_gb_per_s * 1e9)


def exposed_bus_seconds(bus_bytes: float, compute_s: float, hw: Hardware) -> float:
    """Seconds the copies add to a step: what ``offload_overlap`` of the compute cannot hide."""
    copy = bus_bytes / (hw.eff.pcie_gb_per_s * 1e9)
    return max(copy - hw.eff.offload_overlap * compute_s, (1 - hw.eff.offload_overlap) * copy)
