"""Collective costs on a DGX-style cluster: NVLink inside a node, one InfiniBand rail per GPU between nodes.

Ranks are laid out on the mesh ``("pp", "dp", "cp", "tp")`` with tp innermost, so a TP group is ``tp`` consecutive
GPUs, a CP group's members are ``tp`` ranks apart, the dp × cp group that reduces gradients ``tp`` apart too, and
pipeline neighbours ``dp × cp × tp`` apart.
"""

from __future__ import annotations

import functools
import math

from neva.planner.deployment import Deployment
from neva.planner.hardware import Hardware


def _nvlink(hw: Hardware) -> float:
    return hw.nvlink_bytes_per_s * hw.eff.nvlink


def _ib(hw: Hardware) -> float:
    return hw.ib_bytes_per_s * hw.eff.ib


def all_reduce_time(size: float, members: int, per_node: int, hw: Hardware) -> float:
    """Seconds for an all-reduce of ``size`` bytes per rank over ``members`` ranks, ``per_node`` of them per node.

    Hierarchical (what NCCL's rings over NVLink + rails amount to): reduce-scatter inside the node, all-reduce of
    the node's 1/per_node slice across nodes on each GPU's rail, all-gather inside the node.
    """
    if members <= 1 or size <= 0:
        return 0.0
    g = max(1, min(per_node, members))
    n = math.ceil(members / g)
    t = 2 * (g - 1) / g * size / _nvlink(hw) + 2 * (n - 1) / n * (size / g) / _ib(hw)
    hops = (g > 1) + (n > 1)
    return t + hops * hw.eff.latency_us * 1e-6


def half_time(size: float, members: int, per_node: int, hw: Hardware) -> float:
    """A reduce-scatter or all-gather: half an all-reduce's traffic."""
    return all_reduce_time(size, members, per_node, hw) / 2 if members > 1 else 0.0


def tp_group_per_node(dep: Deployment) -> int:
    return min(dep.layout.tp, dep.gpus_per_node)


def dp_group_per_node(dep: Deployment) -> int:
    """Members of one gradient-reduction (dp × cp) group that share a node (peers sit ``tp`` GPUs apart)."""
    return max(1, min(dep.layout.dp_cp, dep.gpus_per_node // dep.layout.tp))


def cp_group_per_node(dep: Deployment) -> int:
    """Members of one context-parallel group that share a node (``tp`` GPUs apart)."""
    return max(1, min(dep.layout.cp, dep.gpus_per_node // dep.layout.tp))


def all_to_all_time(size: float, dep: Deployment, hw: Hardware) -> float:
    """An expert-parallel all-to-all of ``size`` bytes per rank: ``(ep - 1) / ep`` of it leaves the rank (uniform
    routing). An expert group is ``ep`` consecutive ranks of dp (of dp × cp under context parallelism), ``tp`` GPUs
    apart: NVLink while its ``ep × tp`` GPUs share a node, else each rank's rail."""
    ep = dep.layout.ep
    if ep <= 1 or size <= 0:
        return 0.0
    bw = _nvlink(hw) if ep * dep.layout.tp <= dep.gpus_per_node else _ib(hw)
    return (ep - 1) / ep * size / bw + hw.eff.latency_us * 1e-6


def p2p_time(size: float, dep: Deployment, hw: Hardware) -> float:
    """One pipeline send of ``size`` bytes to the neighbouring stage (``dp × cp × tp`` ranks away)."""
    bw = _nvlink(hw) if dep.layout.dp_cp * dep.layout.tp < dep.gpus_per_node else _ib(hw)
    return size / bw + hw.eff.latency_us * 1e-6


@functools.cache
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1), by numerical integration (memoised: a layout search
    asks for the same few ``n`` hundreds of times)."""
    if n <= 1:
        return 0.0
    steps, lo, hi = 4000, -8.0, 8.0
    dx = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * dx
        pdf = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += x * n * pdf * cdf ** (n - 1) * (0.5 if i in (0, steps) else 1.0)
    return total * dx
