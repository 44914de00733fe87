"""``python -m neva.plan``: will a layout fit, and what will it deliver? Predicted before the job is queued.

Takes the same Hydra overrides as ``python -m neva.train``; comma lists of a few layout keys sweep (no ``-m``
needed), e.g.::

    python -m neva.plan model=llama2_13b +stage=finetune cluster=dgx_h100 \\
        model.tensor_model_parallel_size=8 trainer.num_nodes=1,2,4,8,16

Layout search (``plan.search=N``): the N fastest layouts that fit, over TP / PP / SP / DP mode / ZeRO stage /
activation checkpointing / micro-batch size, for the configured model, stage, cluster, nodes, precision and global
batch; a searched key given on the command line (``model.tensor_model_parallel_size=4,8``) limits it to those
values::

    python -m neva.plan +preset=nemo_llama2_13b_finetune trainer.num_nodes=2 plan.search=5

Planner options (not training config): ``plan.text_tokens=N`` (mean text tokens per sample), ``plan.scaling=weak``
(default: the configured global batch is the one of the smallest node count, and grows with the nodes) or
``strong`` (fixed global batch), ``plan.grad_reduce=fp32|bf16``, ``plan.json=PATH`` (also write the JSON there),
``plan.search=N``. Without ``+stage=`` or ``+preset=`` the stage is pretrain.
Prints one table row per layout and a final JSON line (the list of rows). See docs/PLANNER.md.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from dataclasses import replace as field_replace

from neva.config import compose_config
from neva.planner.plan import Plan, plan_run
from neva.planner.report import format_table, to_json
from neva.planner.search import SEARCHED, search
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
    search: int = 0  # > 0: list this many of the fastest fitting layouts instead of planning the given one


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
            elif option == "search":
                req.search = 10 if value.lower() == "true" else 0 if value.lower() == "false" else int(value)
            else:
                raise ConfigError(
                    f"unknown planner option {arg!r} (text_tokens, scaling=weak|strong, grad_reduce, json, search=N)"
                )
        elif "," in value and not value.startswith(("[", "{")):
            if key.lstrip("+") not in SWEEPABLE:
                raise ConfigError(f"{key} cannot be swept; sweepable keys: {', '.join(SWEEPABLE)}")
            req.sweeps.append((key, value.split(",")))
        else:
            req.fixed.append(arg)
    if not any(a.lstrip("+").startswith(("stage=", "preset=")) for a in req.fixed):
        req.fixed.insert(0, "+stage=pretrain")
    return req


def _searched_key(key: str) -> str | None:
    """The ``model.*`` field a command-line key names, when the layout search varies it."""
    field_name = key.lstrip("+").removeprefix("model.")
    return field_name if key.lstrip("+").startswith("model.") and field_name in SEARCHED else None


def _value(text: str) -> int | bool | str | None:
    """A command-line value as the config holds it (``null`` → None, ``true`` → True, digits → int)."""
    low = text.strip().lower()
    if low in ("null", "none", "~"):
        return None
    if low in ("true", "false"):
        return low == "true"
    return int(low) if low.lstrip("-").isdigit() else text.strip()


def split_constraints(req: Request) -> tuple[Request, dict[str, list]]:
    """For a search: the searched keys the command line gives (fixed or swept) become the values the search may
    use, and leave the overrides (the search sets them on every candidate)."""
    constraints: dict[str, list] = {}
    fixed = []
    for arg in req.fixed:
        key, _, value = arg.partition("=")
        name = _searched_key(key)
        if name is None:
            fixed.append(arg)
        else:
            constraints[name] = [_value(value)]
    sweeps = []
    for key, values in req.sweeps:
        name = _searched_key(key)
        if name is None:
            sweeps.append((key, values))
        else:
            constraints[name] = [_value(v) for v in values]
    return field_replace(req, fixed=fixed, sweeps=sweeps), constraints


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


def run_search(req: Request) -> list[Plan]:
    """The ``req.search`` fastest fitting layouts of every point of the remaining sweeps (nodes, cluster, model).

    Raises:
        ConfigError: no layout fits (the message says how many were tried and valid).
    """
    req, constraints = split_constraints(req)
    keys = [k for k, _ in req.sweeps]
    plans = []
    for point in itertools.product(*(v for _, v in req.sweeps)):
        overrides = [f"{k}={v}" for k, v in zip(keys, point)]
        cfg = compose_config(req.fixed + overrides)
        found = search(cfg, constraints, req.search, req.text_tokens, req.grad_reduce)
        where = " ".join(overrides) or "the configured nodes"
        print(
            f"# {where}: {found.tried} layouts tried, {found.valid} accepted by training's checks, {found.fitting} fit"
            f" in {cfg.cluster.gpu_memory_gb:g} GiB; the fastest {len(found.plans)}:"
        )
        if not found.plans:
            raise ConfigError(
                f"no layout fits ({where}: {found.valid} of {found.tried} valid, none within "
                f"{cfg.cluster.gpu_memory_gb:g} GiB); try more nodes, bf16 O2 (trainer.precision=bf16 "
                "model.megatron_amp_O2=true) or a smaller global batch"
            )
        plans.extend(found.plans)
    return plans


def main(argv: list[str] | None = None) -> list[Plan]:
    """Entry point; prints the table and the JSON line and returns the plans."""
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return []
    req = parse_args(args)
    plans = run_search(req) if req.search > 0 else run(req)
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
