"""A run that restores a checkpoint trains it with the recipe of its size, never silently the tiny model's.

The stage's hyperparameters come from the model group's ``recipe`` (``configs/stage/<stage>.yaml`` interpolates
``${recipe.<stage>.*}`` into ``model.*`` / ``trainer.*``). A run that names no model group (``model=``), preset or
canary keeps the embedded default's group, ``tiny``, whose recipe (finetune lr 1e-3, 300 steps) is for the tiny model
only. When such a run restores a checkpoint, the recipe is the one of the model group with a recipe of its own whose
decoder is closest in size to the checkpoint's (``RECIPE_GROUPS``, log-distance of parameter counts): a tiny
checkpoint keeps ``tiny``'s, an imported 7B-class model (Qwen2.5-VL-7B, LLaVA-1.5-7B) gets LLaVA-1.5's 7B recipe
(``model=llama2_7b``: finetune lr 2e-5, global batch 128, one epoch), whatever its family, as the shipped 7B model
groups of every family do. A key the command line gives (the recipe's or its target) is the run's own. The line that
says so names the keys, their values and the group they came from.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from functools import cache
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from neva.checkpoint import neva_format
from neva.checkpoint.trained_with import start_checkpoint
from neva.config import CONFIG_DIR, TrainConfig
from neva.models.config import LLMConfig
from neva.models.presets import LLM_PRESETS
from neva.typed import build

log = logging.getLogger("neva.train")

# Model groups that carry a recipe of their own (the others inherit one of these through their defaults).
RECIPE_GROUPS = ("tiny", "llama2_7b", "llama2_13b", "llama2_70b")
# Command-line choices that pick the recipe themselves.
_CHOOSERS = ("model", "+model", "preset", "+preset", "canary", "+canary")


def decoder_parameters(llm: LLMConfig) -> int:
    """About the decoder's parameters: attention and SwiGLU per layer, embedding and head."""
    per_layer = 4 * llm.hidden_size**2 + 3 * llm.hidden_size * llm.intermediate_size
    return llm.num_layers * per_layer + 2 * llm.vocab_size * llm.hidden_size


@cache
def _group(name: str) -> tuple[int, dict[str, Any]]:
    """A recipe group's decoder size and its recipe (per stage)."""
    data = OmegaConf.to_container(OmegaConf.load(Path(CONFIG_DIR) / "model" / f"{name}.yaml"))
    preset = data["model"]["mm_cfg"]["llm"]["preset"]
    return decoder_parameters(build(LLMConfig, dict(LLM_PRESETS[preset]))), data["recipe"]


def recipe_group(llm: LLMConfig) -> str:
    """The recipe group whose decoder is closest in size to ``llm`` (log scale)."""
    size = math.log(decoder_parameters(llm))
    return min(RECIPE_GROUPS, key=lambda name: abs(math.log(_group(name)[0]) - size))


@cache
def _targets(stage: str) -> dict[str, str]:
    """``{recipe field: dotted key}`` of a stage file's ``${recipe.<stage>.<field>}`` interpolations."""
    data = OmegaConf.to_container(OmegaConf.load(Path(CONFIG_DIR) / "stage" / f"{stage}.yaml"), resolve=False)
    out: dict[str, str] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else key)
        elif isinstance(node, str) and node.startswith(f"${{recipe.{stage}."):
            out[node[len(f"${{recipe.{stage}.") : -1]] = path

    walk(data, "")
    return out


def restored_recipe(cfg: TrainConfig, command_line: list[str] | tuple[str, ...]) -> TrainConfig:
    """``cfg`` with the recipe of its restored checkpoint's size where the run chose none (module docstring)."""
    named = {o.lstrip("+~").split("=", 1)[0] for o in command_line}
    if any(o.split("=", 1)[0] in _CHOOSERS for o in command_line):
        return cfg
    start = start_checkpoint(cfg)
    if start is None:
        return cfg
    llm = neva_format.load_config(start).llm
    group = recipe_group(llm)
    if group == "tiny":
        return cfg
    recipe = _group(group)[1][cfg.stage]
    data = dataclasses.asdict(cfg)
    changed = {}
    for field, key in _targets(cfg.stage).items():
        if key in named or f"recipe.{cfg.stage}.{field}" in named or field not in recipe:
            continue
        *parents, leaf = key.split(".")
        node = data
        for name in parents:
            node = node[name]
        if node[leaf] != recipe[field]:
            node[leaf] = recipe[field]
            changed[key] = recipe[field]
    data["recipe"][cfg.stage] = {**data["recipe"][cfg.stage], **recipe}
    log.info(
        "%s's decoder (~%.1fB parameters) is closest to model=%s's: its %s recipe (%s), not the tiny model's; "
        "choose another with model=<group>, +preset=<name> or the keys themselves",
        start, decoder_parameters(llm) / 1e9, group, cfg.stage, ", ".join(f"{k}={v}" for k, v in changed.items()),
    )  # fmt: skip
    return build(TrainConfig, data)
