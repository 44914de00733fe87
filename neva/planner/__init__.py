"""``neva.plan``'s analytical model: per-rank memory and step time of a training layout, before it is queued.

Nothing here allocates model memory or needs a GPU: parameter shapes come from the real ``NevaModel`` built on the
meta device, and the layout rules (TP / PP / DP sharding, precision, activation checkpointing) turn them into per-rank
bytes. The performance model and its calibration against NVIDIA's published NeVA numbers are described in
``docs/PLANNER.md``.
"""

from neva.planner.deployment import Deployment
from neva.planner.plan import Plan, plan_run

__all__ = ["Deployment", "Plan", "plan_run"]
