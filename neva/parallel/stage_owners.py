"""Which pipeline chunk owns which parameter: one table, read by splitting the model into chunks (``prune_to_chunk``)
and by naming each checkpoint key's stage (``chunk_of_key``: consolidation for export, the planner's per-stage
counts), so the two cannot disagree.

Decoder layers go to chunks by the layer split (``neva.parallel.pipeline.split_layers``); every other part of
``NevaModel`` is named here. A part missing from the table is an error, not a default: a new module says where it
lives.
"""

from __future__ import annotations

from neva.models.neva import NevaModel

FIRST, LAST = "first", "last"

PART_OWNERS: dict[str, str] = {
    # what turns ids and media into the first hidden states: the first chunk
    "vision": FIRST,
    "projector": FIRST,
    "anyres": FIRST,  # the learned image_newline, spliced with the image features
    "video_pool": FIRST,
    "llm.tok_embeddings": FIRST,
    # what turns the last hidden states into logits: the last chunk
    "llm.norm": LAST,
    "llm.output": LAST,
}


def _owner(part: str, num_chunks: int) -> int:
    return 0 if PART_OWNERS[part] == FIRST else num_chunks - 1


def chunk_of_key(key: str, layer_split: list[list[int]]) -> int:
    """Which chunk owns parameter ``key`` of the whole model.

    Raises:
        KeyError: a key of no part in ``PART_OWNERS`` (nor a decoder layer).
    """
    if key.startswith("llm.layers."):
        layer = int(key.split(".")[2])
        return next(c for c, ids in enumerate(layer_split) if layer in ids)
    part = next((p for p in PART_OWNERS if key == p or key.startswith(p + ".")), None)
    if part is None:
        raise KeyError(f"{key!r} belongs to no part of neva.parallel.stage_owners.PART_OWNERS")
    return _owner(part, len(layer_split))


def prune_to_chunk(model: NevaModel, layer_split: list[list[int]], chunk: int) -> NevaModel:
    """Remove, in place, every part of ``model`` that ``chunk`` does not own."""
    keep = {str(i) for i in layer_split[chunk]}
    for name in list(model.llm.layers.keys()):
        if name not in keep:
            del model.llm.layers[name]
    for part in PART_OWNERS:
        if _owner(part, len(layer_split)) != chunk:
            parent, _, attr = part.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, None)
    return model
