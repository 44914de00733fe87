"""Key table between neva's native vision towers + mergers and transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL
``visual`` module.

transformers 5 names the tower ``model.visual.*`` (``Qwen2VLForConditionalGeneration`` & co.); 4.x checkpoints, and
the hub's Qwen checkpoints, name it ``visual.*``. Under that prefix HF keeps the tower and its mergers together; neva
splits them: the tower under ``vision.`` (``neva.models.vision_qwen2`` / ``vision_qwen3``), the mergers under
``projector.`` (``neva.models.projector_merger``). One table per tower kind, ``{}`` standing for the block or
DeepStack merger index; the three share the blocks' attention and norms and differ in the MLP and merger names.
No tensor changes shape: the patch embedding keeps HF's Conv3d weight ``[hidden, C, T, P, P]``.
"""

from __future__ import annotations

import re

import torch

_BLOCKS = {  # neva (under "vision.") : HF (under the visual prefix), every kind
    "patch_embed.weight": "patch_embed.proj.weight",
    "layers.{}.norm1.weight": "blocks.{}.norm1.weight",
    "layers.{}.norm2.weight": "blocks.{}.norm2.weight",
    "layers.{}.attn.qkv.weight": "blocks.{}.attn.qkv.weight",
    "layers.{}.attn.qkv.bias": "blocks.{}.attn.qkv.bias",
    "layers.{}.attn.o_proj.weight": "blocks.{}.attn.proj.weight",
    "layers.{}.attn.o_proj.bias": "blocks.{}.attn.proj.bias",
}
_LAYERNORM_BIASES = {"layers.{}.norm1.bias": "blocks.{}.norm1.bias", "layers.{}.norm2.bias": "blocks.{}.norm2.bias"}
_FC_MLP = {  # Qwen2-VL
    "layers.{}.mlp.fc1.weight": "blocks.{}.mlp.fc1.weight",
    "layers.{}.mlp.fc1.bias": "blocks.{}.mlp.fc1.bias",
    "layers.{}.mlp.fc2.weight": "blocks.{}.mlp.fc2.weight",
    "layers.{}.mlp.fc2.bias": "blocks.{}.mlp.fc2.bias",
}
_GATED_MLP = {  # Qwen2.5-VL
    f"layers.{{}}.mlp.{name}.{kind}": f"blocks.{{}}.mlp.{name}.{kind}"
    for name in ("gate_proj", "up_proj", "down_proj")
    for kind in ("weight", "bias")
}
_QWEN2_MERGER = {  # neva (under "projector.") : HF; the RMSNorm of Qwen2.5-VL has no bias
    "merger.norm.weight": "merger.ln_q.weight",
    "merger.fc1.weight": "merger.mlp.0.weight",
    "merger.fc1.bias": "merger.mlp.0.bias",
    "merger.fc2.weight": "merger.mlp.2.weight",
    "merger.fc2.bias": "merger.mlp.2.bias",
}


def _qwen3_merger(neva: str, hf: str) -> dict[str, str]:
    return {f"{neva}.{p}.{k}": f"{hf}.{q}.{k}" for p, q in (("norm", "norm"), ("fc1", "linear_fc1"),
            ("fc2", "linear_fc2")) for k in ("weight", "bias")}  # fmt: skip


# Per tower kind: (vision table, projector table).
TABLES: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "qwen2_vl": (
        {**_BLOCKS, **_LAYERNORM_BIASES, **_FC_MLP},
        {**_QWEN2_MERGER, "merger.norm.bias": "merger.ln_q.bias"},
    ),
    "qwen2_5_vl": ({**_BLOCKS, **_GATED_MLP}, _QWEN2_MERGER),
    "qwen3_vl": (
        {
            **_BLOCKS,
            **_LAYERNORM_BIASES,
            **{k: v.replace("mlp.fc", "mlp.linear_fc") for k, v in _FC_MLP.items()},
            "patch_embed.bias": "patch_embed.proj.bias",
            "pos_embed.weight": "pos_embed.weight",
        },
        {**_qwen3_merger("merger", "merger"), **_qwen3_merger("deepstack.{}", "deepstack_merger_list.{}")},
    ),
}

PREFIXES = ("model.visual.", "visual.")  # transformers 5's module path; 4.x and the hub checkpoints
EXPORT_PREFIX = "model.visual."


def _patterns(table: dict[str, str], reverse: bool) -> list[tuple[re.Pattern, str]]:
    pairs = ((hf, neva) if not reverse else (neva, hf) for neva, hf in table.items())
    return [(re.compile("^" + re.escape(src).replace(r"\{\}", r"(\d+)") + "$"), dst) for src, dst in pairs]


_COMPILED = {
    (kind, part, reverse): _patterns(table, reverse)
    for kind, tables in TABLES.items()
    for part, table in zip(("vision", "projector"), tables)
    for reverse in (False, True)
}


def _lookup(key: str, patterns: list[tuple[re.Pattern, str]]) -> str | None:
    for pattern, dst in patterns:
        match = pattern.match(key)
        if match:
            return dst.replace("{}", match.group(1)) if match.groups() else dst
    return None


def hf_key_to_neva(key: str, kind: str) -> str | None:
    """Full neva key (``vision.…`` or ``projector.…``) of a full HF key; None for a key outside the visual prefixes
    (the decoder's). A visual key the table does not know is an error: a checkpoint of another kind or version."""
    prefix = next((p for p in PREFIXES if key.startswith(p)), None)
    if prefix is None:
        return None
    rest = key[len(prefix) :]
    for part in ("vision", "projector"):
        neva = _lookup(rest, _COMPILED[kind, part, False])
        if neva is not None:
            return f"{part}.{neva}"
    raise KeyError(f"{key}: not a {kind} vision tower or merger tensor")


def neva_key_to_hf(key: str, kind: str, prefix: str = EXPORT_PREFIX) -> str:
    """Full HF key of a full neva ``vision.…`` / ``projector.…`` key (transformers 5's ``model.visual.`` by
    default; ``visual.`` for 4.x)."""
    part, rest = key.split(".", 1)
    hf = _lookup(rest, _COMPILED[kind, part, True])
    if hf is None:
        raise KeyError(f"{key}: no {kind} HF name")
    return prefix + hf


def state_dict_from_hf(state: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """The tower's and mergers' tensors of an HF state dict under neva's names (other keys are left out)."""
    out = {}
    for key, tensor in state.items():
        neva = hf_key_to_neva(key, kind)
        if neva is not None:
            out[neva] = tensor
    return out


def state_dict_to_hf(state: dict[str, torch.Tensor], kind: str, prefix: str = EXPORT_PREFIX) -> dict[str, torch.Tensor]:
    """neva's ``vision.…`` and ``projector.…`` tensors under HF's names (other keys are left out)."""
    return {neva_key_to_hf(k, kind, prefix): t for k, t in state.items() if k.startswith(("vision.", "projector."))}
