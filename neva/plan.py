"""``python -m neva.plan``: will a layout fit, and what will it deliver? Predicted before the job is queued.

Takes the same Hydra overrides as ``python -m neva.train``; comma lists of a few layout keys sweep (no ``-m``
needed), e.g.::

    python -m neva.plan model=llama2_13b +stage=finetune cluster=dgx_h100 \\
        model.tensor_model_parallel_size=8 trainer.num_nodes=1,2,4,8,16

Planner options (not training config): ``plan.text_tokens=N`` (mean text tokens per sample), ``plan.scaling=weak``
(default: the configured global batch is the one of the smallest node count, and grows with the nodes) or
``strong`` (fixed global batch), ``plan.grad_reduce=fp32|bf16``, ``plan.json=PATH`` (also write the JSON there).
Prints one table row per layout and a final JSON line (the list of rows). See docs/PLANNER.md.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field

from neva.config import compose_config
from neva.planner.plan import Plan, plan_run
from neva.planner.report import format_table, to_json
from neva.typed import ConfigError

SWEEPABLE = (
    "trainer.num_nodes",
    "trainer.devices",
    "cluster",
    "model",
    "vision",
    "model.tensor_model_parallel_size",
    "model.pipeline_model_parallel_size",
    "model.virtual_pipeline_model_parallel_size",
    "model.micro_batch_size",
    "model.global_batch_size",
    "model.sequence_parallel",
    "model.data_parallel",
    "model.zero_stage",
    "model.activations_checkpoint_granularity",
)


@dataclass
class Request:
    """The command line, split into fixed overrides, sweeps and planner options."""

    fixed: list[str] = field(default_factory=list)
    sweeps: list[tuple[str, list[str]]] = field(default_factory=list)
    text_tokens: int | None = None
    scaling: str = "weak"
    grad_reduce: str | None = None
    json_path: str | None = None


def parse_args(argv: list[str]) -> Request:
    """Split ``argv`` (Hydra overrides plus ``plan.*`` options).

    Raises:
        ConfigError: an unknown ``plan.*`` option or a comma list on a key that cannot be swept.
    """
    req = Request()
    for arg in argv:
        if arg in ("-m", "--multirun"):
            continue
        key, _, value = arg.partition("=")
        if key.startswith("plan."):
            option = key[len("plan.") :]
            if option == "text_tokens":
                req.text_tokens = int(value)
            elif option == "scaling" and value in ("weak", "strong"):
                req.scaling = value
            elif option == "grad_reduce":
                req.grad_reduce = value
            elif option == "json":
                req.json_path = value
            else:
                raise ConfigError(
                    f"unknown planner option {arg!r} (text_tokens, scaling=weak|strong, grad_reduce, json)"
                )
        elif "," in value and not value.startswith(("[", "{")):
            if key.lstrip("+") not in SWEEPABLE:
                raise ConfigError(f"{key} cannot be swept; sweepable keys: {', '.join(SWEEPABLE)}")
            req.sweeps.append((key, value.split(",")))
        else:
            req.fixed.append(arg)
    if not any(a.lstrip("+").startswith("stage=") for a in req.fixed):
        req.fixed.insert(0, "+stage=pretrain")
    return req


def run(req: Request) -> list[Plan]:
    """One plan per point of the sweep (cartesian product, in command-line order)."""
    keys = [k for k, _ in req.sweeps]
    points = list(itertools.product(*(v for _, v in req.sweeps))) or [()]
    configs = [compose_config(req.fixed + [f"{k}={v}" for k, v in zip(keys, point)]) for point in points]
    base_nodes = min(c.trainer.num_nodes for c in configs)
    plans = []
    for cfg in configs:
        gbs = None
        if req.scaling == "weak" and cfg.trainer.num_nodes != base_nodes:
            if cfg.trainer.num_nodes % base_nodes:
                raise ConfigError(f"weak scaling needs node counts that are multiples of {base_nodes}")
            gbs = cfg.model.global_batch_size * cfg.trainer.num_nodes // base_nodes
        plans.append(plan_run(cfg, req.text_tokens, gbs, req.grad_reduce))
    return plans


def main(argv: list[str] | None = None) -> list[Plan]:
    """Entry point; prints the table and the JSON line and returns the plans."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return []
    req = parse_args(argv)
    plans = run(req)
    print(format_table(plans))
    line = to_json(plans)
    print(line)
    if req.json_path:
        with open(req.json_path, "w") as f:
            f.write(line + "\n")
    return plans


def cli() -> None:
    """Console script ``neva-plan`` (``main`` returns the plans, which ``sys.exit`` would print)."""
    main()


if __name__ == "__main__":
    cli()
