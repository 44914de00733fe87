"""``model.eval``: the benchmarks and synthetic suites of ``neva.evaluate --suite`` answered by the training model
during training.

``in_training_eval(cfg)`` reads and checks every configured benchmark at start (an unknown name, a missing file or
image stops the run before step 1, with the benchmark's own message naming the file and its expected layout) and
returns what ``neva.training.eval_hook`` calls every ``model.eval.every_n_steps``: the benchmark's questions
answered by this rank's share of the training model (``neva.parallel.generation_model``), with the prompts, decoding
and scorer of ``neva.evaluate`` (``neva.benchmarks``), served with the run's own metadata as its checkpoint would
be. Rank 0 writes ``<exp_dir>/eval/step=N/<benchmark>/answers.jsonl`` and ``scores.json``.

A synthetic suite (``neva.synthetic_suites``) is answered whole by every rank (its scores need every question's
answer under three feeds, and its clips are written once by rank 0). A benchmark's questions are shared: each
data-parallel replica answers every ``dp``-th question (question ``i`` on replica ``i % dp``), and the answers are
gathered over the data-parallel group before scoring, so every rank scores the same answers, in question order.

- Replicas whose forward is their own (one process, DDP, pipeline or tensor parallel groups without FSDP2) decode
  their share alone.
- FSDP2 (sharded parameters: every forward gathers them over the data-parallel ranks) and expert parallelism (an
  all-to-all over data-parallel ranks in every MoE layer) need every replica to run the same forwards: the replicas
  decode their shares in lockstep (``DataParallelLockstep``): the same number of batches (a share one question short
  is filled with a stand-in, its answer dropped), one ``generate`` call per batch (a stand-in where every question
  of a batch is refused), the same step budget, and a batch stops only when every replica's batch is done.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Iterator
from itertools import chain, islice, repeat
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from PIL import Image

from neva.benchmarks.run import Loaded, load_benchmark, run_benchmark
from neva.benchmarks.table import BENCHMARKS
from neva.checkpoint.neva_format import run_metadata
from neva.config import EvalSuiteConfig, TrainConfig
from neva.data.synthetic_video import default_folder, video_records, write_videos
from neva.errors import ConfigError
from neva.inference import Answerer
from neva.models.generation import GenerationConfig
from neva.parallel.generation_model import LayoutGenerationModel
from neva.synthetic_suites import SUITES
from neva.training.engine import Engine
from neva.training.eval_hook import InTrainingEval

log = logging.getLogger(__name__)

SYNTHETIC_MAX_NEW_TOKENS = 16  # neva.evaluate's default for its synthetic suites

NOT_SCORES = ("questions_per_s", "max_new_tokens")
"""Numbers of a benchmark's result that are not scores of the model (timing; a setting)."""


def check_suites(cfg: TrainConfig) -> list[Loaded | None]:
    """Every ``model.eval.suites`` benchmark read and checked (question files, scorer files, images of the questions
    asked); None for a built-in synthetic suite.

    Raises:
        ConfigError: an unknown benchmark, no ``data_dir``, or the benchmark's own refusal (a missing file named with
            the layout expected, absent images).
    """
    m = cfg.model
    loaded = []
    for i, suite in enumerate(m.eval.suites):
        where = f"model.eval.suites[{i}]"
        if suite.name in SUITES:  # generated questions: no files
            loaded.append(None)
            continue
        if suite.name not in BENCHMARKS:
            names = ", ".join([*BENCHMARKS, *SUITES])
            raise ConfigError(f"{where}.name={suite.name!r}: no such benchmark or suite; choose one of {names}")
        if not suite.data_dir:  # a benchmark's files
            raise ConfigError(f"{where}.data_dir: not set (LLaVA's playground/data/eval, or the benchmark's folder)")
        try:
            loaded.append(load_benchmark(suite.name, Path(suite.data_dir), suite.limit))
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
    return loaded


def in_training_eval(cfg: TrainConfig) -> InTrainingEval | None:
    """What the training loop calls every ``model.eval.every_n_steps`` (None: no suites, or never).

    Raises:
        ConfigError: as ``check_suites``.
    """
    loaded = check_suites(cfg)
    if not loaded:
        return None
    if cfg.model.eval.every_n_steps == 0:
        log.warning("model.eval.suites are set but model.eval.every_n_steps=0: they are never run")
        return None
    meta = run_metadata(cfg)
    out = Path(cfg.exp_manager.exp_dir) / "eval"
    seed = cfg.model.data.synthetic_seed

    def evaluate(engine: Engine, tokenizer: Any, step: int) -> dict[str, float]:
        return evaluate_suites(engine, tokenizer, meta, cfg.model.eval.suites, loaded, out / f"step={step}", step, seed)

    return evaluate


def evaluate_suites(
    engine: Engine,
    tokenizer: Any,
    meta: dict[str, Any],
    suites: list[EvalSuiteConfig],
    loaded: list[Loaded | None],
    out: Path,
    step: int,
    seed: int = 0,
) -> dict[str, float]:
    """Answer and score each suite with the training model (every rank calls this); ``eval/<suite>/<metric>``. A
    synthetic suite (``neva.synthetic_suites``, ``seed``: the data's) is answered whole by every rank."""
    model = LayoutGenerationModel(engine.parallel, engine.autocast)
    group = engine.dp_group
    share = group is not None and dist.get_world_size(group) > 1
    lockstep = DataParallelLockstep(group) if share and not model.shares_questions else None
    writer = not dist.is_initialized() or dist.get_rank() == 0
    metrics: dict[str, float] = {}
    try:
        for suite, bench in zip(suites, loaded):
            if bench is None:
                tokens = suite.max_new_tokens or SYNTHETIC_MAX_NEW_TOKENS
                answerer = Answerer.for_model(model, tokenizer, meta, GenerationConfig(max_new_tokens=tokens))
                evaluate_suite, default_limit = SUITES[suite.name]
                limit = suite.limit or default_limit
                if suite.name == "video":
                    _write_clips_once(seed, limit, writer)
                result = evaluate_suite(answerer, limit, seed, suite.batch_size)
                if writer:
                    (out / suite.name).mkdir(parents=True, exist_ok=True)
                    (out / suite.name / "scores.json").write_text(json.dumps(result, indent=1) + "\n")
                metrics.update(flat_scores(f"eval/{suite.name}", result))
                continue
            tokens = suite.max_new_tokens or BENCHMARKS[suite.name].max_new_tokens
            decoding = GenerationConfig(max_new_tokens=tokens, lockstep=lockstep)
            answerer = Answerer.for_model(model, tokenizer, meta, decoding)

            count = len(bench.read.questions)

            def answer_all(items, batch_size, answerer=answerer, count=count):
                if not share:
                    return answerer.answer_all(items, batch_size, keep_going=True)
                return _shared(answerer, items, batch_size, group, count, lockstep is not None)

            with tempfile.TemporaryDirectory() as scratch:  # the ranks that do not write score there
                where = out / suite.name if writer else Path(scratch)
                result = run_benchmark(bench, where, answer_all, f"step={step}", suite.batch_size, tokens)
            metrics.update(flat_scores(f"eval/{suite.name}", result))
    finally:
        model.finish()
    return metrics


def _write_clips_once(seed: int, limit: int, writer: bool) -> None:
    """The video suite's clips written by rank 0 before any rank reads them (every rank writing the same missing
    files into the shared cache folder would race)."""
    if writer:
        write_videos(seed, video_records(seed, "val", limit, "qa"), default_folder(seed))
    if dist.is_initialized():
        dist.barrier()


# What a replica in lockstep decodes where it has no question of its own: one blank image (the tower runs, as it runs
# on its peers' questions) and a word.
STAND_IN = ("?", (Image.new("RGB", (32, 32)),))


class DataParallelLockstep:
    """``generate``'s peers (``neva.models.generation.Lockstep``): the data-parallel ranks, asked by all-reduces."""

    def __init__(self, group: Any) -> None:
        self.group = group
        backend = dist.get_backend(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def fewest(self, n: int) -> int:
        t = torch.tensor([n], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def all_done(self, done: bool) -> bool:
        t = torch.tensor([0 if done else 1], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item()) == 0


def _shared(answerer: Answerer, items: Iterator[Any], batch_size: int, group: Any, count: int, lockstep: bool) -> list:
    """Every item's answer, this data-parallel rank answering items ``rank, rank + dp, ...`` of the ``count`` (the
    items are decoded as they are drawn: the others' are dropped at once); the others' answers gathered (an
    unanswerable item's error travels as its text). ``lockstep``: every rank draws the same number of items (stand-ins
    after its own) and runs one ``generate`` per batch."""
    dp, rank = dist.get_world_size(group), dist.get_rank(group)
    own = len(range(rank, count, dp))
    share: Iterator[Any] = islice(items, rank, None, dp)
    stand_in = None
    if lockstep:
        stand_in = STAND_IN
        share = chain(share, repeat(stand_in, -(-count // dp) - own))
    drawn = answerer.answer_all(share, batch_size, keep_going=True, stand_in=stand_in)
    mine = [a if isinstance(a, str) else ValueError(str(a)) for a in islice(drawn, own)]
    for _ in drawn:  # the stand-ins' batches, run for the peers' sake
        pass
    gathered: list[Any] = [None] * dp
    dist.all_gather_object(gathered, mine, group=group)
    answers: list[Any] = [None] * sum(len(theirs) for theirs in gathered)
    for r, theirs in enumerate(gathered):
        answers[r::dp] = theirs
    return answers


def flat_scores(prefix: str, result: dict[str, Any]) -> dict[str, float]:
    """A benchmark's result as ``prefix/key[/key...]`` → number (nested splits and categories flattened)."""
    out: dict[str, float] = {}
    for key, value in result.items():
        if key in NOT_SCORES:
            continue
        if isinstance(value, dict):
            out.update(flat_scores(f"{prefix}/{key}", value))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}/{key}"] = float(value)
    return out
