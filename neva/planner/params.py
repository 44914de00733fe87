"""Parameter inventory of the real model (built on the meta device) and each rank's share of it.

Layout rules (the ones ``neva/parallel`` applies; see docs/PLANNER.md):

- TP: ``wq wk wv w1 w3`` and ``output`` shard dim 0 (column parallel, ``output`` = vocab parallel), ``wo w2`` shard
  dim 1 (row parallel), ``tok_embeddings`` shards dim 0 (vocab parallel); the projector's Linears alternate column
  / row parallel; norms and the (frozen) vision tower are replicated. LoRA: ``lora_b`` of a column-parallel base shards dim 0, ``lora_a`` of a row-parallel base dim 1.
- PP: the vision tower, projector and ``tok_embeddings`` live on stage 0, ``norm`` and ``output`` on the last stage,
  decoder layers are split in order (``pipeline_first_stage_layers`` on stage 0, the rest evenly, the remainder on the
  later stages, which hold no vision tower).
- FSDP2 (ZeRO-2 and ZeRO-3 alike) shards every (TP-local) parameter on dim 0 in ``torch.chunk`` pieces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from neva.config import MMConfig, PeftConfig
from neva.models.config import NevaConfig
from neva.models.lora import apply_lora
from neva.models.neva import NevaModel
from neva.planner.layout import Layout

_COLWISE = ("wq", "wk", "wv", "w1", "w3", "output")
_ROWWISE = ("wo", "w2")


@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor of the unsharded model.

    Attributes:
        name: fully qualified name (``llm.layers.3.attention.wq.weight``).
        shape: full shape.
        part: ``vision``, ``projector``, ``embedding``, ``layer``, ``norm`` or ``output``.
        layer: decoder layer index for ``layer`` parameters, else None.
        trainable: receives gradients and optimizer state.
        tp_dim: dimension sharded by tensor parallelism, or None (replicated).
        linear: a weight whose matmul costs 2 × numel FLOPs per token (decoder, LM head, projector, vision blocks).
    """

    name: str
    shape: tuple[int, ...]
    part: str
    layer: int | None
    trainable: bool
    tp_dim: int | None
    linear: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def chunk_len(size: int, parts: int, index: int) -> int:
    """Length of piece ``index`` when ``torch.chunk`` splits ``size`` into ``parts`` (the DTensor/FSDP2 rule)."""
    if parts == 1:
        return size
    step = -(-size // parts)
    return max(0, min(step, size - index * step))


def _part_of(name: str) -> tuple[str, int | None]:
    if name.startswith("vision."):
        return "vision", None
    if name.startswith("projector."):
        return "projector", None
    if name.startswith("llm.tok_embeddings."):
        return "embedding", None
    if name.startswith("llm.layers."):
        return "layer", int(name.split(".")[2])
    if name.startswith("llm.output."):
        return "output", None
    return "norm", None


def _tp_dim(name: str, part: str) -> int | None:
    if part == "embedding":
        return 0
    if part == "projector":
        # neva.parallel.tensor_parallel: the projector's Linears alternate column / row parallel.
        pieces = name.split(".")
        position = int(pieces[1]) // 2  # Sequential(Linear, GELU, Linear, ...): Linear k sits at index 2k
        if position % 2 == 0:
            return 0
        return 1 if pieces[-1] == "weight" else None
    if part not in ("layer", "output"):
        return None
    pieces = name.split(".")
    if pieces[-2] in ("lora_a", "lora_b"):
        base = pieces[-3]
        if base in _COLWISE and pieces[-2] == "lora_b":
            return 0
        if base in _ROWWISE and pieces[-2] == "lora_a":
            return 1
        return None
    owner = pieces[-2] if pieces[-1] in ("weight", "bias") else ""
    if owner == "base":  # a LoRA-wrapped Linear keeps its weight under ``<name>.base``
        owner = pieces[-3]
    if owner in _COLWISE:
        return 0
    if owner in _ROWWISE:
        return 1
    return None


def meta_model(cfg: NevaConfig, mm: MMConfig, peft: PeftConfig) -> NevaModel:
    """The model on the meta device with the run's freezing (and LoRA adapters) applied; nothing is allocated."""
    with torch.device("meta"):
        model = NevaModel(cfg)
    if model.vision is not None:
        model.vision.requires_grad_(not mm.vision_encoder.freeze)
    if model.projector is not None:
        model.projector.requires_grad_(not mm.freeze_projector)
    if peft.peft_scheme == "lora":
        # NeMo's LoRA finetune: the whole decoder is frozen and only the adapters (and the projector) train.
        model.llm.requires_grad_(False)
        lora = peft.lora_tuning
        apply_lora(model, lora.target_modules, lora.adapter_dim, lora.alpha, lora.adapter_dropout)
    else:
        model.llm.requires_grad_(not mm.llm.freeze)
    return model


def model_inventory(cfg: NevaConfig, mm: MMConfig, peft: PeftConfig) -> list[ParamInfo]:
    """``inventory(meta_model(...))``, memoised: building even a meta 70B model takes a second, and sweeps reuse it."""
    key = repr((cfg, mm.vision_encoder.freeze, mm.freeze_projector, mm.llm.freeze, peft))
    if key not in _INVENTORIES:
        _INVENTORIES[key] = inventory(meta_model(cfg, mm, peft))
    return _INVENTORIES[key]


_INVENTORIES: dict[str, list[ParamInfo]] = {}


def inventory(model: NevaModel) -> list[ParamInfo]:
    """Every parameter tensor of ``model`` (tied weights once), classified for the layout rules."""
    infos = []
    for name, p in model.named_parameters():
        part, layer = _part_of(name)
        linear = p.dim() == 2 and part in ("vision", "projector", "layer", "output")
        infos.append(ParamInfo(name, tuple(p.shape), part, layer, p.requires_grad, _tp_dim(name, part), linear))
    return infos


def stage_layers(num_layers: int, layout: Layout) -> list[list[int]]:
    """Decoder layer indices each pipeline stage (rank of the pp dim) holds, all its virtual chunks together."""
    pp, v = layout.pp, layout.vpp
    if pp == 1:
        return [list(range(num_layers))]
    if v > 1:
        # Interleaved: chunk c (of pp × v, each num_layers / (pp × v) layers) lives on rank c % pp.
        chunks = pp * v
        size = num_layers // chunks
        if size * chunks != num_layers:
            raise ValueError(f"{num_layers} layers do not split into {chunks} virtual pipeline chunks")
        return [[i for c in range(r, chunks, pp) for i in range(c * size, (c + 1) * size)] for r in range(pp)]
    first = layout.first_stage_layers
    counts: list[int]
    if first is None:
        base, extra = divmod(num_layers, pp)
        counts = [base + (1 if r >= pp - extra else 0) for r in range(pp)]
    else:
        base, extra = divmod(num_layers - first, pp - 1)
        counts = [first] + [base + (1 if r >= pp - 1 - extra else 0) for r in range(pp - 1)]
    starts = [sum(counts[:r]) for r in range(pp)]
    return [list(range(s, s + c)) for s, c in zip(starts, counts)]


def on_stage(info: ParamInfo, stage: int, layers: list[list[int]]) -> bool:
    """Whether pipeline stage ``stage`` holds ``info``."""
    if info.part in ("vision", "projector", "embedding"):
        return stage == 0
    if info.part in ("norm", "output"):
        return stage == len(layers) - 1
    return info.layer in layers[stage]


def local_numel(info: ParamInfo, layout: Layout, tp_rank: int = 0, dp_rank: int = 0) -> int:
    """Elements of ``info`` stored at rest on the rank at (tp_rank, dp_rank) of a stage holding it."""
    shape = list(info.shape)
    if info.tp_dim is not None and layout.tp > 1:
        shape[info.tp_dim] = chunk_len(shape[info.tp_dim], layout.tp, tp_rank)
    if layout.sharded:
        shape[0] = chunk_len(shape[0], layout.dp, dp_rank)
    return math.prod(shape)


def tp_numel(info: ParamInfo, layout: Layout, tp_rank: int = 0) -> int:
    """Elements of ``info`` after tensor parallelism only (what a rank computes with, FSDP all-gathered)."""
    shape = list(info.shape)
    if info.tp_dim is not None and layout.tp > 1:
        shape[info.tp_dim] = chunk_len(shape[info.tp_dim], layout.tp, tp_rank)
    return math.prod(shape)
