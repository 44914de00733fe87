"""Plain parameter names: the whole model's names, whatever wraps a parameter (activation checkpointing, compile).

Checkpoints, HF key tables, the optimizer's parameter groups and export all speak these names, so a parameter keeps
its name under every layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import nn

from neva.models.lora import LoRALinear

# Wrappers that insert a module level into parameter names; checkpoints never contain them.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """The plain model name of a (possibly wrapped) parameter name."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def named_parameters(parts: Iterable[nn.Module]) -> Iterator[tuple[str, nn.Parameter]]:
    """``(plain name, parameter)`` over the model parts this rank holds (pipeline chunks are disjoint)."""
    seen: set[int] = set()
    for part in parts:
        for name, p in part.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield canonical_name(name), p


def lora_layers(parts: Iterable[nn.Module]) -> dict[str, LoRALinear]:
    """The LoRA layers of ``parts`` by plain module name (the owners ``neva.models.lora.plain_key`` takes)."""
    return {canonical_name(n): m for part in parts for n, m in part.named_modules() if isinstance(m, LoRALinear)}
