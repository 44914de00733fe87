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
``plan.search=N``, ``plan.num_frames=N`` (a video model: each sample one video of N frames instead of one image), ``plan.rehearse=true`` (pre-flight: also run one real optimizer step of every rank role at full size on
fake tensors and print its measured memory beside the prediction; exits non-zero when the real path fails, 2 when
this torch cannot rehearse), ``plan.image_size=HxW`` (AnyRes: a typical image, whose tiles and positions the data
side's rule gives; default the worst case, the largest pinpoint), ``plan.image_tokens=N`` (AnyRes: the data's mean
positions per image) or ``plan.image_tokens=data`` (that mean measured from the image headers of a seeded sample of
at most 2000 records of ``model.data.data_path``; unreadable ones skipped and counted; the output names the source),
``plan.max_pixels=N`` (a native-resolution tower's pixel budget per image: the planned image is the largest it lets
through, or ``plan.image_size`` resized within it; default ``model.data.max_pixels``, else the tower kind's). Without ``+stage=``, ``+preset=`` or ``+canary=`` the stage is pretrain.
Prints one table row per layout and a final JSON line (the list of rows). See docs/PLANNER.md.
"""

from __future__ import annotations

import itertools
import sys
import traceback
from dataclasses import dataclass, field
from dataclasses import replace as field_replace

from neva.config import TrainConfig, compose_config
from neva.errors import entry_point
from neva.planner.caveats import caveat_lines
from neva.planner.images import describe_images, parse_image_size, parse_image_tokens, parse_max_pixels
from neva.planner.plan import GiB, Plan, learned_fraction_of, plan_run, text_tokens_of
from neva.planner.report import format_table, to_json
from neva.planner.search import SEARCHED, search
from neva.training.rehearsal import ENOUGH_MICRO_BATCHES, RankMemory, RehearsalUnavailable, rehearse
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
    num_frames: int | None = None  # each sample one video of this many frames (a video model)
    scaling: str = "weak"
    grad_reduce: str | None = None
    json_path: str | None = None
    search: int = 0  # > 0: list this many of the fastest fitting layouts instead of planning the given one
    rehearse: bool = False  # also run the real step of every rank role on fake tensors (neva.training.rehearsal)
    image_size: tuple[int, int] | None = None  # AnyRes: a typical image (height, width); None: the worst case
    image_tokens: float | str | None = None  # AnyRes: mean positions per image, or "data" (measured)
    max_pixels: int | None = None  # a native tower's pixel budget per image (None: the data's, else the kind's)


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
                req.text_tokens = _integer(arg, value)
            elif option == "num_frames":
                req.num_frames = _integer(arg, value)
            elif option == "scaling" and value in ("weak", "strong"):
                req.scaling = value
            elif option == "grad_reduce":
                req.grad_reduce = value
            elif option == "json":
                req.json_path = value
            elif option == "rehearse" and value.lower() in ("true", "false"):
                req.rehearse = value.lower() == "true"
            elif option == "image_size":
                try:
                    req.image_size = parse_image_size(value)
                except ValueError as err:
                    raise ConfigError(str(err)) from err
            elif option == "image_tokens":
                try:
                    req.image_tokens = parse_image_tokens(value)
                except ValueError as err:
                    raise ConfigError(str(err)) from err
            elif option == "max_pixels":
                try:
                    req.max_pixels = parse_max_pixels(value)
                except ValueError as err:
                    raise ConfigError(str(err)) from err
            elif option == "search":
                req.search = 10 if value.lower() == "true" else 0 if value.lower() == "false" else _integer(arg, value)
            else:
                raise ConfigError(
                    f"unknown planner option {arg!r} (text_tokens, num_frames, scaling=weak|strong, grad_reduce, json, "
                    "search=N, rehearse=true|false, image_size=HxW, image_tokens=N|data, max_pixels=N)"
                )
        elif "," in value and not value.startswith(("[", "{", "'", '"')):  # a quoted value is one value
            if key.lstrip("+") not in SWEEPABLE:
                raise ConfigError(f"{key} cannot be swept; sweepable keys: {', '.join(SWEEPABLE)}")
            req.sweeps.append((key, value.split(",")))
        else:
            req.fixed.append(arg)
    if not any(a.lstrip("+").startswith(("stage=", "preset=", "canary=")) for a in req.fixed):
        req.fixed.insert(0, "+stage=pretrain")
    return req


def _integer(arg: str, value: str) -> int:
    """An integer planner option's value.

    Raises:
        ConfigError: not an integer, naming the option.
    """
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{arg}: expected an integer") from None


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


def configs_of(req: Request) -> list[TrainConfig]:
    """The composed config of every point of the sweep (cartesian product, in command-line order)."""
    keys = [k for k, _ in req.sweeps]
    points = list(itertools.product(*(v for _, v in req.sweeps))) or [()]
    return [compose_config(req.fixed + [f"{k}={v}" for k, v in zip(keys, point)]) for point in points]


def run(req: Request) -> list[Plan]:
    """One plan per point of the sweep (cartesian product, in command-line order)."""
    configs = configs_of(req)
    base_nodes = min(c.trainer.num_nodes for c in configs)
    plans = []
    for cfg in configs:
        gbs = None
        if req.scaling == "weak" and cfg.trainer.num_nodes != base_nodes:
            if cfg.trainer.num_nodes % base_nodes:
                raise ConfigError(f"weak scaling needs node counts that are multiples of {base_nodes}")
            gbs = cfg.model.global_batch_size * cfg.trainer.num_nodes // base_nodes
        plans.append(
            plan_run(
                cfg,
                req.text_tokens,
                gbs,
                req.grad_reduce,
                num_frames=req.num_frames,
                image_size=req.image_size,
                image_tokens=req.image_tokens,
                max_pixels=req.max_pixels,
            )
        )
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
        found = search(
            cfg, constraints, req.search, req.text_tokens, req.grad_reduce, req.image_size, req.image_tokens,
            req.max_pixels, req.num_frames,
        )  # fmt: skip
        where = " ".join(overrides) or "the configured nodes"
        print(
            f"# {where}: {found.tried} layouts tried, {found.valid} accepted by training's checks, {found.fitting} fit"
            f" in {cfg.cluster.gpu_memory_gb:g} GiB; the fastest {len(found.plans)}:"
        )
        if found.offload:  # none fit without them: the search turned offload knobs on (neva.planner.offload)
            keys = " ".join(f"model.{k}=true" for k in found.offload)
            print(f"# none fits without offload: these need {keys} (host memory and bus traffic in their plans)")
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
    if req.rehearse and req.search > 0:
        raise ConfigError("plan.rehearse=true rehearses the configured layout; it cannot be combined with plan.search")
    if req.rehearse and req.image_tokens is not None:  # a mean has no image size for the rehearsal's real batch
        raise ConfigError("plan.rehearse=true runs real images of one size: give plan.image_size=HxW, not "
                          "plan.image_tokens")  # fmt: skip
    plans = run_search(req) if req.search > 0 else run(req)
    print(format_table(plans))
    images = [p.extra["image"] for p in plans]
    shown = [image for image in images if image["size"] or "source" in image or image.get("tiled")]
    for line in sorted({describe_images(image) for image in shown}):
        print(line)
    for caveat in dict.fromkeys(line for cfg in configs_of(req)[:1] for line in caveat_lines(cfg, plans)):
        print(caveat)  # what the plan cannot know: a close "fits", packed rows
    if req.rehearse:
        for cfg, plan in zip(configs_of(req), plans):
            print(rehearse_against_plan(cfg, plan, req.text_tokens, req.num_frames))
    line = to_json(plans)
    print(line)
    if req.json_path:
        with open(req.json_path, "w") as f:
            f.write(line + "\n")
    return plans


def rehearse_against_plan(cfg: TrainConfig, plan: Plan, text_tokens: int | None, num_frames: int | None = None) -> str:
    """Rehearse ``cfg``'s layout and format the measured memory of every rank role beside ``plan``'s prediction,
    on samples of the plan's shape (its AnyRes image size, ``num_frames``' video).

    A failure of the real path ends the command with exit status 1 and the error; a torch that cannot rehearse with
    status 2 and one line (``neva.training.rehearsal.RehearsalUnavailable``)."""
    tokens = text_tokens if text_tokens is not None else text_tokens_of(cfg)
    try:
        size = plan.extra["image"]["size"]
        measured = rehearse(cfg, tokens, learned_fraction_of(cfg), micro_batches=ENOUGH_MICRO_BATCHES,
                            image_size=None if size is None else tuple(size), num_frames=num_frames)  # fmt: skip
    except RehearsalUnavailable as err:
        print(f"rehearsal unavailable: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as err:
        traceback.print_exc()
        print(f"rehearsal failed: {type(err).__name__}: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    return format_rehearsal(plan, measured)


def format_rehearsal(plan: Plan, measured: list[RankMemory]) -> str:
    """Measured (fake-tensor step) and planned GiB per rank role; totals exclude the planner's overhead term."""
    head = ("stage", "rank", "", "params", "grads", "optim", "activ", "temp", "work", "total_GiB", "dev", "peak at")
    rows = [head]
    for r in measured:
        s = plan.stages[r.stage]
        c = {k: v / GiB for k, v in r.categories.items()}
        planned = (s.total - s.overhead) / GiB
        got = r.peak / GiB
        rows.append((str(r.stage), str(r.rank), "rehearsed", f"{c['params']:.2f}", f"{c['grads']:.2f}",
                     f"{c['optimizer']:.2f}", f"{c['activations']:.2f}", f"{c['temporaries']:.2f}",
                     f"{c['working'] + c['other']:.2f}", f"{got:.2f}", "", r.where))  # fmt: skip
        rows.append(("", "", "planned", f"{s.params / GiB:.2f}", f"{s.grads / GiB:.2f}", f"{s.optimizer / GiB:.2f}",
                     f"{s.activations / GiB:.2f}", "-", f"{s.working / GiB:.2f}", f"{planned:.2f}",
                     f"{100 * (planned - got) / max(got, 1e-9):+.1f}%", ""))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    title = (
        f"# rehearsal: one real optimizer step per rank role on fake tensors (tensor storage; the planner's "
        f"{plan.stages[0].overhead / GiB:g} GiB overhead is not included in either total)"
    )
    lines = [title, *("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)]
    cp = plan.deployment.layout.cp
    if cp > 1:
        lines.append(
            f"# context parallelism: cp rank 0 rehearsed; its activ includes a [S/{2 * cp}, S] causal mask per layer "
            "that the CPU attention keeps and CUDA's FlexAttention does not (docs/PLANNER.md, 'Rehearsal')"
        )
    return "\n".join(lines)


@entry_point
def cli(argv: list[str] | None = None) -> None:
    """Console script ``neva-plan``: ``main`` under the input-error rule of ``neva.errors`` (``main`` raises, for
    callers that plan; it returns the plans, which ``sys.exit`` would print)."""
    main(argv)


if __name__ == "__main__":
    cli()
