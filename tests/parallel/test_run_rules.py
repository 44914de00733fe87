"""One verdict per run: the support matrix, the planner and training's start give the same answer, with the same
message, on every cell of ``python -m neva.support`` (``neva.parallel.run_rules.check_run`` is the one list of
start-time rules they all ask). Each side gets its inputs its own way: the matrix its cell (``support.check_layout``),
the planner the cell's config (``plan_run``, and the layout search constrained to the cell's layout), training the
world from ``trainer.devices`` (``resolve_layout``) and its precision policy (``neva.training.start_checks``). Meta
models only (one per row, as the matrix builds them: the layout does not change the model); nothing is allocated."""

from __future__ import annotations

import dataclasses

import pytest

from neva import support
from neva.config import TrainConfig, compose_config
from neva.models.trainable import build_meta_model
from neva.parallel.layout import resolve_layout
from neva.planner.plan import plan_run
from neva.planner.search import SEARCHED, search
from neva.training.dpo import PreferenceObjective
from neva.training.start_checks import check_start
from neva.typed import ConfigError

# Cells on which the five lists of rules disagreed before there was one (the matrix's rows and columns as it builds
# them): each is refused now by all three, with training's message.
DISAGREED = [
    # support and plan_run (and the search) accepted what only training's engine refused
    (support.row("LLaVA's micro-batch mean", keys={"model.loss_normalization": "micro_batch_mean"}),
     support.Column("CP 2 + PP 2", 4, {"context_parallel_size": 2, "pipeline_model_parallel_size": 2}),
     "the pipeline's loss sees one shard"),
    # refused by training's pipeline runner only
    (support.row("CLIP + Llama"),
     support.Column("PP 2 interleaved, no virtual stages", 2,
                    {"pipeline_model_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b"}),
     "interleaved_1f1b needs model.virtual_pipeline_model_parallel_size >= 2"),
    # refused by training's module only
    (support.row("nothing trained", ["+stage=pretrain"], {"model.mm_cfg.freeze_projector": True}),
     support.Column("1 GPU", 1, {}), "no trainable parameters"),
    # the preference stage's settings (its spec's check): packed pairs where the head runs at every position
    (support.row("dpo, packed rows", ["+stage=dpo", "model.restore_from_path=/nowhere"], {"model.data.packing": True}),
     support.Column("TP 2", 2, {"tensor_model_parallel_size": 2}), "stage=dpo: model.data.packing"),
    # a stage that generates on the training model (its spec's rollout): SP's padding and a recurrent state
    (support.row("grpo, Qwen3.5's linear attention", ["+stage=grpo", "model.restore_from_path=/nowhere",
                                                       "model=tiny_qwen3_5", "vision=tiny_qwen3_5"]),
     support.Column("TP 2 + SP", 2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
     "generation under model.sequence_parallel=true is not built for linear-attention layers"),
]  # fmt: skip


def verdict(check) -> str:
    """``yes``, or the refusal's message."""
    try:
        check()
    except ConfigError as err:
        return str(err)
    return "yes"


def planner_verdicts(run: TrainConfig) -> tuple[str, bool]:
    """(``plan_run``'s verdict, whether the layout search proposes the cell's layout when every searched key is held
    at the cell's value; fits aside: the memory is made ample)."""
    run = dataclasses.replace(run, cluster=dataclasses.replace(run.cluster, gpu_memory_gb=10_000.0))
    planned = verdict(lambda: plan_run(run))
    held = {k: [getattr(run.model, k)] for k in SEARCHED}
    return planned, search(run, held, top=0).valid == 1


def training_verdict(run: TrainConfig, model) -> str:
    """Training's start on the cell: the world from ``trainer.devices``, then ``check_start`` (what
    ``checked_meta_model`` asks of the model it builds)."""
    return verdict(lambda: check_start(run, resolve_layout(run), model, PreferenceObjective.of(run)))


def row_model(cfg: TrainConfig):
    return build_meta_model(support.architecture(cfg), cfg.model.trainable_policy())


def cell_verdicts(cfg: TrainConfig, column: support.Column, model, cluster) -> tuple[str, str, bool, str]:
    run = dataclasses.replace(support.column_config(cfg, column), cluster=cluster)
    matrix = verdict(lambda: support.check_layout(cfg, column, model))
    planned, searched = planner_verdicts(run)
    return matrix, planned, searched, training_verdict(run, model)


@pytest.fixture
def launcher_free(monkeypatch):
    """No launcher's variables: the world is ``trainer.devices`` (``neva.parallel.layout.world_size``)."""
    for var in ("WORLD_SIZE", "SLURM_NTASKS", "RANK", "SLURM_PROCID", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_every_cell_of_the_support_matrix_gets_one_verdict(launcher_free):
    """Every cell of the matrix, then the cells the lists disagreed on (each refused by all three, with training's
    message)."""
    cluster = compose_config(["+stage=finetune", "cluster=dgx_h100"]).cluster  # a GPU's peak; no rule reads it
    composed: dict = {}
    cells = [(row, column, None) for row in support.ROWS for column in support.LAYOUTS] + DISAGREED
    disagree, refused, rows = [], 0, {}
    for row, column, message in cells:
        if repr(row) not in rows:  # the row's config and meta model, once
            cfg = support.compose_row(row, composed)
            rows[repr(row)] = cfg, row_model(cfg)
        cfg, model = rows[repr(row)]
        matrix, planned, searched, trained = cell_verdicts(cfg, column, model, cluster)
        refused += matrix != "yes"
        same = matrix == planned == trained and searched == (matrix == "yes")
        if not same or (message is not None and message not in matrix):
            disagree.append(f"{row.label} × {column.label}: matrix {matrix!r}, plan_run {planned!r}, "
                            f"search {'proposes' if searched else 'refuses'}, training {trained!r}")  # fmt: skip
    assert not disagree, "\n".join(disagree)
    assert 0 < refused < len(cells)  # both verdicts met
