"""What a checkpoint was trained with travels with it: a run that starts from a neva checkpoint takes the data
settings that checkpoint records (``neva_format.RUN_DATA_KEYS``: template, system prompt, chat-template choice,
tokenization, image handling, a native tower's pixel budget, the video frame budget) for every key the run does not
set itself, and says so; a key it sets to another value than the checkpoint's is kept, and that is said too.

"Set by the run" is a key on the command line, or one a config file (a preset, a model or data group) gives another
value than ``neva.yaml``'s default: the one rule is ``given_data_keys``. The conversation template of a pretraining
checkpoint (``plain``: captions, no turns) is not a chat format and is never taken over (with it the system prompt and
the chat-template choice stay the run's too): a finetune after a pretrain renders its own template, as before.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from neva.checkpoint import neva_format
from neva.checkpoint.source import default_start
from neva.config import CONFIG_DIR, TrainConfig
from neva.errors import ConfigError
from neva.stages import stage_spec

log = logging.getLogger("neva.train")

# Keys that go with the template: taken over only together with it.
TEMPLATE_KEYS = ("conv_template", "system_prompt", "use_chat_template")
# Another key that chooses the template (NeMo's model_type, when conv_template is null).
_MODEL_TYPE = "model.mm_cfg.llm.model_type"


def given_data_keys(dcfg: DictConfig, command_line: list[str] | tuple[str, ...]) -> set[str]:
    """The ``model.data`` keys (of ``RUN_DATA_KEYS``) this run sets itself: on the command line, or given another
    value by a config file than ``neva.yaml``'s default. ``dcfg``: the composed (unresolved) config."""
    root = OmegaConf.load(Path(CONFIG_DIR) / "neva.yaml")
    named = {o.lstrip("+~").split("=", 1)[0] for o in command_line}
    given = set()
    for key in neva_format.RUN_DATA_KEYS:
        path = f"model.data.{key}"
        default = OmegaConf.select(root, path, default=None)
        value = OmegaConf.select(dcfg, path, default=None, throw_on_missing=False)
        if path in named or value != default:
            given.add(key)
    model_type = OmegaConf.select(dcfg, _MODEL_TYPE, default=None)
    if _MODEL_TYPE in named or model_type != OmegaConf.select(root, _MODEL_TYPE, default=None):
        given.add("conv_template")  # NeMo's way of choosing the template
    return given


def start_checkpoint(cfg: TrainConfig) -> str | None:
    """The neva checkpoint a run starts from (``model.restore_from_path``, or a stage's default start), None when it
    starts from HF weights or fresh, or when that path holds no neva checkpoint (``resolve_source`` says why)."""
    restore = cfg.model.restore_from_path
    if restore is None and stage_spec(cfg.stage).starts_from and not cfg.model.mm_cfg.llm.from_pretrained:
        restore = default_start(cfg)
    return restore if restore is not None and neva_format.is_neva_checkpoint(restore) else None


def recorded_settings(metadata: dict[str, Any]) -> dict[str, Any]:
    """The data settings a checkpoint's metadata records (``RUN_DATA_KEYS``), the template's only when it is a chat
    format (not a pretraining checkpoint's ``plain``)."""
    recorded = {k: metadata[k] for k in neva_format.RUN_DATA_KEYS if k in metadata}
    if recorded.get("conv_template") in (None, "plain"):
        for key in TEMPLATE_KEYS:
            recorded.pop(key, None)
    return recorded


def inherit_trained_with(cfg: TrainConfig, given: set[str]) -> TrainConfig:
    """``cfg`` with the data settings its starting checkpoint records for every key not in ``given``; one line lists
    what was taken, one what the run overrides (both on rank 0's log, so the first screen shows them)."""
    start = start_checkpoint(cfg)
    if start is None:
        return cfg
    recorded = recorded_settings(neva_format.load_metadata(start))
    if "conv_template" in given:  # a template of the run's own: its system prompt and chat-template choice too
        recorded = {k: v for k, v in recorded.items() if k not in TEMPLATE_KEYS or k in given}
    data = cfg.model.data
    taken = {k: v for k, v in recorded.items() if k not in given and getattr(data, k) != v}
    overridden = {k: v for k, v in recorded.items() if k in given and getattr(data, k) != v}
    if taken:
        log.info(
            "from %s (what it was trained with): %s",
            start,
            ", ".join(f"model.data.{k}={v!r}" for k, v in taken.items()),
        )
    if overridden:
        log.info(
            "this run overrides what %s was trained with: %s",
            start,
            ", ".join(f"model.data.{k}={getattr(data, k)!r} (trained: {v!r})" for k, v in overridden.items()),
        )
    if not taken:
        return cfg
    try:
        data = dataclasses.replace(data, **taken)
    except ValueError as err:  # the run's own value beside one taken from the checkpoint (min_pixels > max_pixels)
        taken_text = ", ".join(f"model.data.{k}={v!r}" for k, v in taken.items())
        raise ConfigError(f"{err} ({taken_text} from {start}: what it was trained with)") from None
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, data=data))
