"""LLaVA's released LoRA checkpoints (``llava-v1.5-7b-lora``): what ``load_pretrained_model(model_path, model_base)``
loads, read as plain tensors so that ``import_llava_original`` merges them.

The directory holds LLaVA's ``config.json`` (``mm_*`` keys), PEFT's ``adapter_config.json`` and
``adapter_model.bin`` / ``.safetensors`` (``base_model.model.<HF key minus .weight>.lora_A|B.weight``), and
``non_lora_trainables.bin`` (what trained besides LoRA: the projector). The decoder it adapts is ``model_base`` (an HF
Llama directory, e.g. vicuna-7b-v1.5). LLaVA's loader strips ``base_model.`` and then ``model.`` from the
non-LoRA keys when they start ``model.model.``, loads them into the base, and merges each adapter as PEFT does:
``W + (lora_alpha / r) · B @ A``. The same here, in fp32, cast back to the weight's dtype.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from neva.checkpoint.hf_read import _load_bin
from neva.checkpoint.safetensors_io import iter_safetensors
from neva.typed import ConfigError

ADAPTER_CONFIG = "adapter_config.json"
NON_LORA = "non_lora_trainables.bin"
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PEFT_PREFIX = "base_model.model."
# adapter_config.json entries a plain LoRA merge reproduces only at these values (name → accepted values)
_MERGE_SETTINGS = {"use_dora": (False, None), "fan_in_fan_out": (False, None), "bias": ("none", None),
                   "rank_pattern": ({}, None), "alpha_pattern": ({}, None), "modules_to_save": (None, [])}  # fmt: skip


def is_llava_lora(directory: str | os.PathLike) -> bool:
    """A LoRA run's output: PEFT's ``adapter_config.json`` beside LLaVA's ``config.json``."""
    return (Path(directory) / ADAPTER_CONFIG).is_file()


@dataclass
class LlavaLora:
    """A LLaVA LoRA directory read: the weight deltas under the base's HF keys, and the non-LoRA tensors under
    LLaVA's own keys (``model.mm_projector.*``)."""

    deltas: dict[str, torch.Tensor]
    non_lora: dict[str, torch.Tensor]
    rank: int
    alpha: float


def read_llava_lora(directory: str | os.PathLike) -> LlavaLora:
    """Read the adapter and the non-LoRA trainables of a LLaVA LoRA directory.

    Raises:
        ConfigError: a missing file, or an adapter setting a plain merge does not reproduce (DoRA, per-module ranks,
            a trained bias), named.
    """
    directory = Path(directory)
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    for key, accepted in _MERGE_SETTINGS.items():
        if config.get(key) not in accepted:
            raise ConfigError(f"{directory / ADAPTER_CONFIG}: {key}={config.get(key)!r} is not supported (plain LoRA)")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / (rank**0.5 if config.get("use_rslora") else rank)
    files = [directory / name for name in ADAPTER_FILES if (directory / name).is_file()]
    if not files:
        raise ConfigError(f"{directory}: no {' or '.join(ADAPTER_FILES)} beside {ADAPTER_CONFIG}")
    state = dict(iter_safetensors(files[:1])) if files[0].suffix == ".safetensors" else _load_bin(files[0])
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in key:
                module = key.split(marker)[0].removeprefix(_PEFT_PREFIX)
                pairs.setdefault(module, {})[part] = tensor
                break
        else:
            raise ConfigError(f"{files[0]}: {key!r} is not a LoRA tensor (lora_A / lora_B)")
    deltas = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise ConfigError(f"{files[0]}: {module} has {sorted(ab)} only (needs lora_A and lora_B)")
        deltas[f"{module}.weight"] = scale * (ab["lora_B"].float() @ ab["lora_A"].float())
    non_lora = {}
    if (directory / NON_LORA).is_file():
        # builder.py: strip "base_model.", then "model." when the keys start "model.model."
        raw = {k.removeprefix("base_model."): v for k, v in _load_bin(directory / NON_LORA).items()}
        if any(k.startswith("model.model.") for k in raw):
            raw = {k.removeprefix("model."): v for k, v in raw.items()}
        non_lora = raw
    return LlavaLora(deltas, non_lora, rank, alpha)
