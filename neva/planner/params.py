"""Parameter inventory of the real model (built on the meta device) and each rank's share of it.

The layout rules are training's own, imported from ``neva/parallel`` (see docs/PLANNER.md):

- TP: ``tensor_parallel.tp_shard_dims``, read off the plan ``apply_tensor_parallel`` applies (column-parallel
  ``wq wk wv w1 w3``, LM head and first projector Linear on dim 0, row-parallel ``wo w2`` on dim 1, the
  vocab-parallel embedding on dim 0, norms and the frozen vision tower replicated).
- PP: ``pipeline.split_layers`` cuts the decoder into pp × vpp chunks, pipeline rank r holds chunks r, r + pp, ...
  (``local_chunks``), and ``chunk_of_key`` puts the vision tower, projector and embedding on chunk 0, the final norm
  and LM head on the last chunk.
- Freezing and LoRA: ``models.trainable.build_meta_model`` with the run's ``TrainablePolicy``.
- FSDP2 (ZeRO-2 and ZeRO-3 alike) shards every (TP-local) parameter on dim 0 in ``torch.chunk`` pieces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from neva.models.config import NevaConfig
from neva.models.neva import NevaModel
from neva.models.trainable import TrainablePolicy, build_meta_model
from neva.parallel.layout import Layout
from neva.parallel.pipeline import local_chunks, split_layers
from neva.parallel.stage_owners import chunk_of_key
from neva.parallel.tensor_parallel import tp_shard_dims


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


def meta_model(cfg: NevaConfig, policy: TrainablePolicy) -> NevaModel:
    """``build_meta_model(cfg, policy)``, memoised: building even a meta 70B model takes a second, and sweeps and
    layout searches ask for the same one again (its inventory, training's tensor-parallel check)."""
    key = repr((cfg, policy))
    if key not in _META_MODELS:
        _META_MODELS[key] = build_meta_model(cfg, policy)
    return _META_MODELS[key]


def model_inventory(cfg: NevaConfig, policy: TrainablePolicy) -> list[ParamInfo]:
    """``inventory`` of the memoised meta model."""
    key = repr((cfg, policy))
    if key not in _INVENTORIES:
        _INVENTORIES[key] = inventory(meta_model(cfg, policy))
    return _INVENTORIES[key]


_META_MODELS: dict[str, NevaModel] = {}
_INVENTORIES: dict[str, list[ParamInfo]] = {}


def inventory(model: NevaModel) -> list[ParamInfo]:
    """Every parameter tensor of ``model`` (tied weights once), classified for the layout rules."""
    tp_dims = tp_shard_dims(model)
    infos = []
    for name, p in model.named_parameters():
        part, layer = _part_of(name)
        linear = p.dim() == 2 and part in ("vision", "projector", "layer", "output")
        infos.append(ParamInfo(name, tuple(p.shape), part, layer, p.requires_grad, tp_dims[name], linear))
    return infos


def stage_layers(num_layers: int, layout: Layout) -> list[list[int]]:
    """Decoder layer indices each pipeline stage (rank of the pp dim) holds, all its virtual chunks together.

    Raises:
        ConfigError: the layers do not fill the pp × vpp chunks (``split_layers``).
    """
    chunks = split_layers(num_layers, layout.num_chunks, layout.first_stage_layers)
    return [[i for c in local_chunks(r, layout.pp, layout.vpp) for i in chunks[c]] for r in range(layout.pp)]


def on_stage(info: ParamInfo, stage: int, layers: list[list[int]]) -> bool:
    """Whether pipeline stage ``stage`` holds ``info``, given ``stage_layers``.

    A stage's layers are the union of its chunks, and chunk 0 (vision, projector, embedding) runs on the first stage
    and the last chunk (norm, LM head) on the last, so training's ``chunk_of_key`` over the stages' layers names the
    stage.
    """
    if len(layers) == 1:  # one stage holds everything (and the layout search plans thousands of these)
        return stage == 0
    return chunk_of_key(info.name, layers) == stage


def is_expert(info: ParamInfo) -> bool:
    """A stacked MoE expert tensor ``[E, ., .]`` (``feed_forward.experts.w1|w3|w2``)."""
    return ".experts." in info.name


def local_numel(info: ParamInfo, layout: Layout, tp_rank: int = 0, dp_rank: int = 0) -> int:
    """Elements of ``info`` stored at rest on the rank at (tp_rank, dp_rank) of a stage holding it.

    Expert tensors under expert parallelism: ``E / ep`` experts per rank, FSDP2-sharded over the ``dp · cp / ep``
    replicas of the expert group (``neva.parallel.data_parallel.apply_fsdp``; groups drawn from dp × cp,
    ``neva.parallel.mesh``). ``dp_rank``: the rank's place in dp × cp."""
    shape = list(info.shape)
    if info.tp_dim is not None and layout.tp > 1:
        shape[info.tp_dim] = chunk_len(shape[info.tp_dim], layout.tp, tp_rank)
    shards = layout.dp_cp  # FSDP2 shards over dp × cp
    if is_expert(info) and layout.ep > 1:
        shape[0] = chunk_len(shape[0], layout.ep, dp_rank % layout.ep)
        shards, dp_rank = layout.dp_cp // layout.ep, dp_rank // layout.ep
    if layout.sharded and shards > 1:
        shape[0] = chunk_len(shape[0], shards, dp_rank)
    return math.prod(shape)


def tp_numel(info: ParamInfo, layout: Layout, tp_rank: int = 0) -> int:
    """Elements of ``info`` after tensor parallelism only (what a rank computes with, FSDP all-gathered; a rank's own
    ``E / ep`` experts under expert parallelism)."""
    shape = list(info.shape)
    if info.tp_dim is not None and layout.tp > 1:
        shape[info.tp_dim] = chunk_len(shape[info.tp_dim], layout.tp, tp_rank)
    if is_expert(info) and layout.ep > 1:
        shape[0] = chunk_len(shape[0], layout.ep, 0)
    return math.prod(shape)
