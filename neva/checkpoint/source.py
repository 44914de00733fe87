"""Where a run's architecture, tokenizer and initial weights come from: fresh init, a neva checkpoint, or HF Llama +
CLIP weights (``resolve_source``). The architecture is worked out in ``architecture`` (from the run's settings) and
``restored_architecture`` (a checkpoint's, under them); the weights are filled in by ``initial_weights``."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from neva.checkpoint import neva_format
from neva.checkpoint.architecture import hf_dir, neva_config_from_mm, read_hf_config
from neva.checkpoint.restored_architecture import restored_config
from neva.config import TrainConfig
from neva.data.templates.registry import image_token_for
from neva.data.tokens import add_special_tokens, tokenizer_image_token_id
from neva.hf_local import LocalModelError
from neva.models.config import NevaConfig
from neva.models.neva import NevaModel
from neva.stages import stage_spec
from neva.typed import ConfigError

log = logging.getLogger(__name__)


@dataclass
class ModelSource:
    """Where a run's architecture, tokenizer and initial weights come from."""

    cfg: NevaConfig
    tokenizer: Any
    checkpoint: str | None = None  # neva checkpoint to load weights from; None = fresh init (or HF import)
    hf_llm: str | None = None
    hf_vision: str | None = None
    projector_weights: str | None = None  # LLaVA's mm_projector.bin (model.mm_cfg.pretrain_mm_mlp_adapter)
    # Parameters the run added to the checkpoint's architecture (stage two's AnyRes ``anyres.image_newline``): not in
    # ``checkpoint``, they start fresh from ``seed`` (the run's model.seed).
    added: tuple[str, ...] = ()
    seed: int = 0


def default_start(cfg: TrainConfig) -> str:
    """Where a stage without ``model.restore_from_path`` starts: ``<root>/<the stage before>/final`` beside the run's
    own ``exp_manager.exp_dir`` (``<root>/<stage>``), so that stages given one root (``exp_manager.exp_dir=<root>/
    pretrain``, then ``<root>/finetune``; ``NEVA_OUTPUT_ROOT``; the SLURM scripts) find each other; by default
    ``outputs/pretrain/final`` for a finetune, ``outputs/finetune/final`` for DPO."""
    root = os.path.dirname(os.path.normpath(cfg.exp_manager.exp_dir))
    return os.path.join(root, stage_spec(cfg.stage).starts_from[0], "final")


def missing_start(restore: str, cfg: TrainConfig) -> ConfigError:
    """The refusal of a stage whose default starting point is not there: one line naming where it looked, and the
    default root's output of the stage before when that one exists (run without this run's exp_dir)."""
    before, made = stage_spec(cfg.stage).starts_from
    where = f"{restore} (beside exp_manager.exp_dir={cfg.exp_manager.exp_dir})"
    other = os.path.join(os.environ.get("NEVA_OUTPUT_ROOT", "outputs"), before, "final")
    if os.path.abspath(other) != os.path.abspath(restore) and neva_format.is_neva_checkpoint(other):
        return ConfigError(
            f"{cfg.stage} starts from {where}, which holds no neva checkpoint, and will not take {other} instead: "
            f"pass model.restore_from_path={other} to start from it, or give both stages one root "
            f"(exp_manager.exp_dir=<root>/{before}, then <root>/{cfg.stage})"
        )
    return ConfigError(
        f"{cfg.stage} needs a {made} model and none was found at {where}. Run `python -m neva.train "
        f"+stage={before}` with the same root first (exp_manager.exp_dir=<root>/{before} for <root>/{cfg.stage}), or "
        f"pass model.restore_from_path=/path/to/neva_checkpoint (a {before} stage's final checkpoint, or `python -m "
        "neva.convert hf-to-neva` output)."
    )


def resolve_source(cfg: TrainConfig) -> ModelSource:
    """Decide the starting point of a run.

    A stage without ``model.restore_from_path`` starts from the output of the stage before it beside its
    ``exp_dir`` (the stage spec's ``starts_from``, ``default_start``); a missing starting point is a config error that says what to
    run.
    """
    restore = cfg.model.restore_from_path
    if restore is None and stage_spec(cfg.stage).starts_from and not cfg.model.mm_cfg.llm.from_pretrained:
        restore = default_start(cfg)
        if not neva_format.is_neva_checkpoint(restore):
            raise missing_start(restore, cfg)
    adapter = cfg.model.mm_cfg.pretrain_mm_mlp_adapter
    if adapter is not None and not os.path.isfile(adapter):
        raise ConfigError(f"model.mm_cfg.pretrain_mm_mlp_adapter={adapter!r}: no such file (LLaVA's mm_projector.bin)")
    if restore is not None and adapter is not None:
        raise ConfigError(
            f"model.mm_cfg.pretrain_mm_mlp_adapter={adapter!r} with model.restore_from_path={restore!r}: the checkpoint "
            "already holds a projector. Drop one of them (LLaVA uses the adapter to finetune from an HF LLM: "
            "model.mm_cfg.llm.from_pretrained)."
        )
    if restore is not None:
        return _restored_source(cfg, restore)
    mm = cfg.model.mm_cfg
    if mm.llm.from_pretrained:
        from neva.checkpoint.hf_assemble import prepare_tokenizer

        read_hf_config(mm.llm.from_pretrained, "model.mm_cfg.llm")  # a .nemo, neva or LLaVA path: say so first
        try:
            tokenizer = prepare_tokenizer(mm.llm.from_pretrained)
        except LocalModelError as err:
            raise ConfigError(f"model.mm_cfg.llm.from_pretrained: {err}") from err
        neva_cfg = _fresh_config(cfg, tokenizer)
        vision = mm.vision_encoder.from_pretrained
        return ModelSource(
            neva_cfg,
            tokenizer,
            hf_llm=hf_dir(mm.llm.from_pretrained, "model.mm_cfg.llm"),
            hf_vision=hf_dir(vision, "model.mm_cfg.vision_encoder") if vision else None,
            projector_weights=adapter,
        )
    from neva.data.synthetic import build_tokenizer

    tokenizer = build_tokenizer()
    return ModelSource(_fresh_config(cfg, tokenizer), tokenizer, projector_weights=adapter)


def _fresh_config(cfg: TrainConfig, tokenizer: Any) -> NevaConfig:
    """The architecture of a run that starts without a neva checkpoint, sized to ``tokenizer``; the tokens the
    tower family's image text holds besides the image token (``TowerSpec.image_text_tokens``: Pixtral's row breaks)
    added to a tokenizer that lacks them, and their ids set."""
    mm, ratio = cfg.model.mm_cfg, cfg.model.data.image_aspect_ratio
    neva_cfg = neva_config_from_mm(mm, len(tokenizer), _image_token_id(cfg, tokenizer), ratio)
    tokens = None if neva_cfg.vision is None else neva_cfg.vision.spec.image_text_tokens
    if not tokens:
        return neva_cfg
    add_special_tokens(tokenizer, list(tokens.values()))
    neva_cfg = neva_config_from_mm(mm, len(tokenizer), _image_token_id(cfg, tokenizer), ratio)
    return replace(neva_cfg, **{name: tokenizer.convert_tokens_to_ids(text) for name, text in tokens.items()})


def _image_token_id(cfg: TrainConfig, tokenizer: Any) -> int:
    return tokenizer_image_token_id(tokenizer, image_token_for(cfg.model.data.conv_template))


def _restored_source(cfg: TrainConfig, restore: str) -> ModelSource:
    """A neva checkpoint's architecture (with what stage two adds), tokenizer and weights."""
    neva_format.refuse_nemo_checkpoint(restore, "model.restore_from_path")
    if not neva_format.is_neva_checkpoint(restore):
        raise ConfigError(
            f"model.restore_from_path={restore!r} is not a neva checkpoint directory, nor an HF Qwen-VL / llava-hf "
            "directory (imported on the fly); convert other HF models with `python -m neva.convert hf-to-neva`"
        )
    log.info("starting from neva checkpoint %s", restore)
    ckpt_cfg = neva_format.load_config(restore)
    neva_cfg = restored_config(cfg.model.mm_cfg, cfg.model.data.image_aspect_ratio, ckpt_cfg, restore)
    added = _new_parameters(neva_cfg, ckpt_cfg)
    if neva_cfg is not ckpt_cfg:
        log.info(
            "added to the architecture of %s: %s%s", restore,
            ", ".join(f"{part} {getattr(neva_cfg, part)}" for part in ("anyres", "video")
                      if getattr(neva_cfg, part) != getattr(ckpt_cfg, part)),
            f"; new parameters {list(added)} start fresh (model.seed={cfg.model.seed})" if added else "",
        )  # fmt: skip
    return ModelSource(
        neva_cfg, neva_format.load_tokenizer(restore), checkpoint=restore, added=added, seed=cfg.model.seed
    )


def _new_parameters(cfg: NevaConfig, ckpt: NevaConfig) -> tuple[str, ...]:
    """Parameters of ``cfg``'s model that ``ckpt``'s lacks (models built on meta: nothing is allocated)."""
    if cfg is ckpt:
        return ()
    with torch.device("meta"):
        have = set(NevaModel(ckpt).state_dict())
        return tuple(k for k in NevaModel(cfg).state_dict() if k not in have)
