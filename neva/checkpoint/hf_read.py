"""Reading HF directories: weight files (safetensors or ``pytorch_model.bin``, sharded or not), tensors and their
shapes, ``config.json``, a projector file, the image processor's statistics, and the HF → neva key mapping with the
checks every import makes before it reads a tensor.

Everything streams tensor by tensor (``safe_open`` / memory-mapped ``torch.load``), so a conversion never holds more
than one copy of the weights plus one output shard. HF configs are read through ``AutoConfig`` because hub
``config.json`` files often omit fields that transformers fills with defaults (llava-1.5-7b-hf's ``text_config`` has no
``hidden_size``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint.hf_keys import detect_prefixes, hf_key_to_neva
from neva.checkpoint.hf_moe import canonical_shapes, canonical_tensors, expert_groups
from neva.checkpoint.neva_format import TIED_HEAD_KEY, check_shape, expected_shapes
from neva.checkpoint.safetensors_io import INDEX_NAME, WEIGHTS_NAME, index_files, iter_safetensors, safetensors_shapes
from neva.hf_local import from_local
from neva.models.config import NevaConfig

BIN_NAME = "pytorch_model.bin"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# HF tensors neva does not keep: rotary buffers of old checkpoints, CLIP's / SigLIP's text tower and contrastive heads,
# SigLIP's attention-pooling head (its contrastive image embedding; LLaVA reads hidden states and never runs it).
_IGNORED = re.compile(
    r"(rotary_emb\.inv_freq$|position_ids$|^text_model\.|^logit_scale$|^logit_bias$|^text_projection\.|"
    r"^visual_projection\.|^(model\.)?(vision_tower\.|vision_model\.)*head\.)"
)


def hf_weight_files(directory: str | os.PathLike) -> list[Path]:
    """Weight files of an HF directory: safetensors (sharded or not), else ``pytorch_model.bin`` (sharded or not).

    Raises:
        FileNotFoundError: none of them exists.
    """
    directory = Path(directory)
    for index_name, single in ((INDEX_NAME, WEIGHTS_NAME), (BIN_INDEX_NAME, BIN_NAME)):
        if (directory / index_name).is_file():
            return index_files(directory / index_name)
        if (directory / single).is_file():
            return [directory / single]
    raise FileNotFoundError(f"no {WEIGHTS_NAME}, {INDEX_NAME}, {BIN_NAME} or {BIN_INDEX_NAME} in {directory}")


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    # mmap keeps the file on disk and pages tensors in as they are touched; weights_only refuses pickled code.
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # pre-zip (torch < 1.6) files cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True)


def iter_hf_tensors(directory: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF key, tensor)`` from an HF directory, one file open at a time (Mixtral experts stacked:
    ``hf_moe``)."""
    groups = expert_groups(_raw_shapes(directory))
    yield from canonical_tensors(_raw_tensors(directory), groups)


def _raw_tensors(directory: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    files = hf_weight_files(directory)
    if files[0].suffix == ".safetensors":
        yield from iter_safetensors(files)
        return
    for path in files:
        state = _load_bin(path)
        while state:
            key = next(iter(state))
            yield key, state.pop(key)
        del state


def hf_tensor_shapes(directory: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in an HF directory (safetensors headers; ``.bin`` files are memory-mapped), as
    ``iter_hf_tensors`` yields them."""
    return canonical_shapes(_raw_shapes(directory))


def _raw_shapes(directory: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    files = hf_weight_files(directory)
    if files[0].suffix == ".safetensors":
        return safetensors_shapes(files)
    return {key: tuple(t.shape) for path in files for key, t in _load_bin(path).items()}


def read_projector_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A published projector file → ``{neva projector key: tensor}``.

    LLaVA's ``--pretrain_mm_mlp_adapter`` file (``mm_projector.bin``: a ``torch.save`` dict of
    ``model.mm_projector.{i}.weight|bias``, read with ``weights_only=True``), or a safetensors file under the same or
    llava-hf (``multi_modal_projector.linear_{n}``) names.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a key that is not a projector tensor (names it).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"projector weights {path}: no such file")
    state = dict(iter_safetensors([path])) if path.suffix == ".safetensors" else _load_bin(path)
    mapping = map_keys(list(state), detect_prefixes(list(state), parts=("projector",)), path)
    return {mapping[k]: t for k, t in state.items() if k in mapping}


def load_hf_config(directory: str | os.PathLike) -> dict[str, Any]:
    """An HF ``config.json`` with transformers' defaults filled in (``AutoConfig(...).to_dict()``)."""
    from transformers import AutoConfig

    return from_local(AutoConfig, directory).to_dict()


def _image_processor_dict(directory: Path) -> dict[str, Any] | None:
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = directory / name
        if path.is_file():
            data = json.loads(path.read_text())
            data = data.get("image_processor", data)
            if "image_mean" in data:
                return data
    return None


def with_image_stats(cfg: NevaConfig, directory: Path) -> NevaConfig:
    """Take ``image_mean``/``image_std`` from the directory's image processor config if it has one."""
    proc = _image_processor_dict(directory)
    if proc is None or cfg.vision is None:
        return cfg
    vision = dataclasses.replace(
        cfg.vision, image_mean=tuple(proc["image_mean"]), image_std=tuple(proc.get("image_std", cfg.vision.image_std))
    )
    return dataclasses.replace(cfg, vision=vision)


def has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def map_keys(hf_keys: list[str], prefixes: dict[str, str], source: Path) -> dict[str, str]:
    """HF key → neva key for every key kept; unknown keys that are not knowingly dropped are an error."""
    mapping, unknown = {}, []
    for key in hf_keys:
        neva = hf_key_to_neva(key, prefixes)
        if neva is not None:
            mapping[key] = neva
        elif not _IGNORED.search(key):
            unknown.append(key)
    if unknown:
        raise ValueError(f"{source}: {len(unknown)} tensor(s) with no neva counterpart, e.g. {unknown[:5]}")
    return mapping


# The embedding and LM head rows an import adds for ``<image>``, ``<pad>`` and vocabulary padding.
GROWN_KEYS = ("llm.tok_embeddings.weight", TIED_HEAD_KEY)


def grow_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """Append rows equal to the mean of the existing ones (a neutral start for new tokens, as LLaVA does)."""
    if weight.shape[0] >= rows:
        return weight
    mean = weight.float().mean(dim=0, keepdim=True).to(weight.dtype)
    return torch.cat([weight, mean.expand(rows - weight.shape[0], -1)])


def check_complete(cfg: NevaConfig, produced: dict[str, tuple[int, ...]], source: str) -> None:
    """Every tensor of ``cfg``'s model is ``produced`` (neva key -> shape), with its shape, before anything is read."""
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(produced))
    if missing:
        raise ValueError(f"{source}: {len(missing)} model tensor(s) not found, e.g. {missing[:5]}")
    extra = sorted(set(produced) - set(expected))
    if extra:  # a known HF name the config's model lacks (e.g. Qwen3's q/k norms under a config without them)
        raise ValueError(f"{source}: {len(extra)} tensor(s) the config's model does not have, e.g. {extra[:5]}")
    for key, shape in produced.items():
        if key in expected:
            check_shape(key, shape, expected[key], source, grows=key in GROWN_KEYS)


def cast_floating(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` in ``dtype`` if it is floating point (integer buffers keep theirs); None keeps it."""
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
