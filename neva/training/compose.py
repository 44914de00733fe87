"""Compose and validate a run config outside ``@hydra.main`` (tests, ``neva.plan``, the benchmark)."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from neva.training.config import TrainConfig
from neva.typed import build

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """Resolve interpolations and validate against the typed schema."""
    data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    data.pop("hydra", None)
    return build(TrainConfig, data)


def compose_config(overrides: list[str] | None = None, config_name: str = "neva") -> TrainConfig:
    """The validated config for ``overrides`` (as on the command line, e.g. ``["+stage=pretrain"]``)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return to_train_config(compose(config_name, overrides=overrides or []))
