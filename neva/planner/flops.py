"""FLOPs per pipeline stage and per GPU: the terms of ``neva.models.flops`` (the one FLOP count, which metrics.csv
and the benchmark use too) placed on the stage that runs them, divided over its TP ranks, plus activation-checkpoint
recomputation."""

from __future__ import annotations

from dataclasses import dataclass

from neva.models.config import NevaConfig
from neva.models.flops import FlopTerm, attended_square, chunked_square, flop_terms
from neva.parallel.compute_plans import checkpointed_blocks
from neva.parallel.layout import Layout
from neva.parallel.pipeline import split_layers
from neva.planner.params import ParamInfo, on_stage


@dataclass(frozen=True)
class StageFlops:
    """FLOPs of one pipeline stage for one sample.

    Attributes:
        model: useful FLOPs (each matmul counted once across TP ranks; what MFU divides by).
        per_gpu: what one GPU of the stage executes: TP-sharded parts divided by tp, replicated parts (vision
            tower, LoRA factors on the unsharded side) in full, everything divided by cp, plus
            activation-checkpointing recomputation.
        backward: whether this stage runs a backward pass at all.
    """

    model: float
    per_gpu: float
    backward: bool


def _placement(term: FlopTerm, params: dict[str, ParamInfo], layers: list[list[int]]) -> tuple[int, bool]:
    """(pipeline stage, TP-sharded) of ``term``."""
    info = params.get(term.name)
    if info is not None:
        return next(s for s in range(len(layers)) if on_stage(info, s, layers)), info.tp_dim is not None
    # Not a parameter: an attention core (the decoder's split its heads over TP ranks, the replicated vision
    # tower's runs in full), or an LM head tied to the embedding (vocab parallel, on the last stage).
    if term.layer is not None:
        return next(s for s, held in enumerate(layers) if term.layer in held), True
    if term.name.startswith("vision."):
        return 0, False
    return len(layers) - 1, True


def stage_flops(
    infos: list[ParamInfo],
    cfg: NevaConfig,
    layout: Layout,
    seq_len: int,
    layers: list[list[int]],
    tiles: int = 1,
    frames: int = 0,
    grid: tuple[int, int] | None = None,
) -> list[StageFlops]:
    """FLOPs per sample of each pipeline stage for samples of ``seq_len`` tokens with one image each, of ``tiles``
    tower inputs (AnyRes: the overview and the grid's tiles, each through the tower and the projector; a native
    tower: the image's patches, ``grid`` its height and width in patches, whose windows its attention counts), or
    with one video of ``frames`` frames each (``frames`` > 0)."""
    terms = _terms(infos, cfg, grid)
    square = attended_square(seq_len, cfg.llm.sliding_window)
    units = {
        "token": seq_len, "token2": square, "token2_full": seq_len * seq_len, "image": 0 if frames else tiles,
        "frame": frames,
        "token2_chunked": chunked_square(seq_len, cfg.llm.attention_chunk_size) if cfg.llm.attention_chunk_size else 0,
    }  # fmt: skip
    params = {p.name: p for p in infos}
    model = [0.0] * len(layers)
    per_gpu = [0.0] * len(layers)
    backward = [False] * len(layers)
    share: dict[str, float] = {}
    for t in terms:
        stage, sharded = _placement(t, params, layers)
        # Context parallelism: every rank runs 1/cp of the tokens, of the (load-balanced) causal attention square and
        # of the tower inputs.
        share[t.name] = (1 / layout.tp if sharded else 1.0) / layout.cp
        model[stage] += t.total * units[t.per]
        per_gpu[stage] += t.total * units[t.per] * share[t.name]
        backward[stage] = backward[stage] or t.backward > 0
    recomputed = checkpointed_layers(layout, cfg.llm.num_layers)
    for stage, held in enumerate(layers):
        for i in held:
            mine = [t for t in terms if t.layer == i]
            if i in recomputed and any(t.backward for t in mine):
                if layout.ac == "selective":  # Megatron's selective recompute: only the attention core
                    mine = [t for t in mine if t.name.endswith(".core")]
                per_gpu[stage] += sum(t.forward * units[t.per] * share[t.name] for t in mine)
    return [StageFlops(m, g, b) for m, g, b in zip(model, per_gpu, backward)]


def _terms(infos: list[ParamInfo], cfg: NevaConfig, grid: tuple[int, int] | None = None) -> list[FlopTerm]:
    """``flop_terms`` of the inventory, memoised: they do not depend on the layout, which a search varies."""
    params = tuple((p.name, p.shape, p.trainable) for p in infos)
    key = (repr(cfg), params, grid)
    if key not in _TERMS:
        _TERMS[key] = flop_terms(params, cfg, grid)
    return _TERMS[key]


_TERMS: dict[tuple, list[FlopTerm]] = {}


def checkpointed_layers(layout: Layout, num_layers: int) -> frozenset[int]:
    """Decoder layers that training wraps in activation checkpointing under ``layout`` (each pipeline chunk's first
    ``ac_num_layers`` blocks; ``neva.parallel.compute_plans.checkpointed_blocks``)."""
    chunks = split_layers(num_layers, layout.num_chunks, layout.first_stage_layers)
    return frozenset(i for chunk in chunks for i in checkpointed_blocks(chunk, layout.ac, layout.ac_num_layers))
