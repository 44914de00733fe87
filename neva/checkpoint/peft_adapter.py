"""LoRA as a PEFT adapter for the llava-hf and Qwen-VL exports: ``adapter_config.json`` + ``adapter_model.safetensors``.

PEFT names an adapter tensor ``base_model.model.<HF module path>.lora_A|lora_B.weight`` and a fully saved module
(``modules_to_save``) ``base_model.model.<HF key>``; the paths are module names of the model transformers 4.52+ / 5.x
builds from the export (``hf_keys.MODULE_PREFIXES``: PEFT addresses modules of the loaded model, whatever the
checkpoint's key layout), so the adapter fits the model ``neva.convert neva-to-hf`` writes under those versions. PEFT computes ``W x + (alpha / r) · B A x``, neva's ``LoRALinear``
exactly (rsLoRA off).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from neva.checkpoint.atomic import atomic_directory
from neva.checkpoint.hf_keys import MODULE_PREFIXES, neva_key_to_hf
from neva.models.lora import LoRALinear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def hf_module(neva_module: str) -> str:
    """HF module path of a neva Linear (``llm.layers.0.attention.wq`` → ``model.language_model.layers.0.self_attn.
    q_proj``)."""
    return neva_key_to_hf(f"{neva_module}.weight", MODULE_PREFIXES).removesuffix(".weight")


def save_peft_adapter(
    out: str | os.PathLike,
    lora_layers: dict[str, LoRALinear],
    saved_parts: dict[str, dict[str, torch.Tensor]],
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    saved_key: Callable[[str], str] | None = None,
    saved_modules: dict[str, tuple[str, ...]] | None = None,
) -> Path:
    """Write a PEFT LoRA adapter directory.

    Args:
        out: adapter directory to create.
        lora_layers: LoRA layers by plain neva module name (``neva.models.lora.split_state_dict``).
        saved_parts: whole parts the run trained besides the adapters (``{"projector": {neva key: tensor}}``),
            saved as PEFT ``modules_to_save``, so the adapter also applies to the base the run started from.
        dtype: tensor dtype (default fp32).
        overwrite: replace an existing ``out``.
        saved_key / saved_modules: the HF name of a saved part's tensor (neva key → HF key) and each part's module
            name for ``modules_to_save``, for a family whose parts are not llava-hf's (Qwen-VL: ``model.visual.*``);
            None: llava-hf's (``MODULE_PREFIXES``). The decoder's LoRA paths are the same in both.

    Raises:
        ValueError: no LoRA layer, or layers of different ranks or scales (one PEFT config holds one of each).
    """
    if not lora_layers:
        raise ValueError("the checkpoint has no LoRA layers: there is no adapter to export")
    shapes = {(m.lora_a.out_features, m.scale, m.p) for m in lora_layers.values()}
    if len(shapes) != 1:
        raise ValueError(f"LoRA layers of different (rank, scale, dropout) {sorted(shapes)}: not one PEFT config")
    rank, scale, dropout = shapes.pop()
    dtype = dtype or torch.float32
    tensors: dict[str, torch.Tensor] = {}
    for name, layer in lora_layers.items():
        path = PEFT_PREFIX + hf_module(name)
        tensors[f"{path}.lora_A.weight"] = layer.lora_a.weight.detach().to(dtype)
        tensors[f"{path}.lora_B.weight"] = layer.lora_b.weight.detach().to(dtype)
    saved_key = saved_key or (lambda key: neva_key_to_hf(key, MODULE_PREFIXES))
    modules = saved_modules or {
        part: (MODULE_PREFIXES[part].removeprefix("model.").rstrip("."),) for part in saved_parts
    }
    for state in saved_parts.values():
        for key, value in state.items():
            tensors[PEFT_PREFIX + saved_key(key)] = value.detach().to(dtype)
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": None,
        "r": rank,
        "lora_alpha": scale * rank,
        "lora_dropout": dropout,
        "use_rslora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        # Full module paths: PEFT matches a list entry against the end of a module name, and CLIP's attention has
        # q_proj / v_proj too.
        "target_modules": sorted(hf_module(name) for name in lora_layers),
        "modules_to_save": sorted({name for part in saved_parts for name in modules[part]}) or None,
    }
    with atomic_directory(out, overwrite) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS), {"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return Path(out)
