"""neva checkpoint → LLaVA's own layout (haotian-liu/LLaVA ``llava_llama``, LLaVA-NeXT's ``llava_mistral`` /
``llava_qwen``): what LLaVA's ``load_pretrained_model`` and its trainer read, and ``llava_original`` reads back.

The directory: ``config.json`` (the decoder's HF config under LLaVA's model type, with the ``mm_*`` keys), the
decoder and projector weights under LLaVA's keys (``model.*``, ``lm_head.weight``, ``model.mm_projector.*``), the
tokenizer, and the vision tower as its own CLIP directory (``vision_tower/``, what ``mm_vision_tower`` names: LLaVA
builds the tower from that directory, not from the checkpoint's weights). With ``projector_only`` it is what LLaVA's
pretrain stage saves instead: ``config.json`` + ``mm_projector.bin`` (the decoder stays the HF model it started from).

What LLaVA's classes cannot express is refused with the reason: AnyRes and video (LLaVA-NeXT's own settings, not
written here), NeMo's ``mlp_downsample``, a bias-free projector, several concatenated tower layers, SigLIP towers,
MoE decoders.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint.atomic import atomic_directory
from neva.checkpoint.hf_config import llava_config_dict
from neva.checkpoint.hf_files import make_tokenizer_4_readable
from neva.checkpoint.hf_keys import LLAVA_ORIGINAL_PROJECTOR, LM_HEAD, part_key_to_hf
from neva.checkpoint.hf_processors import tower_image_processor
from neva.checkpoint.hf_read import cast_floating
from neva.checkpoint.llava_original import PROJECTOR_FILE
from neva.checkpoint.neva_format import iter_tensors, load_config, load_metadata, load_tokenizer
from neva.checkpoint.safetensors_io import DEFAULT_MAX_SHARD_BYTES, write_safetensors
from neva.constants import IMAGE_TOKEN
from neva.families import decoder_spec
from neva.models.config import NevaConfig
from neva.typed import ConfigError

TOWER_DIR = "vision_tower"


def llava_refusal(cfg: NevaConfig) -> str | None:
    """Why ``cfg`` has no LLaVA-original layout (None: it has one)."""
    family = cfg.llm.family
    if decoder_spec(family).llava is None:
        return f"decoder family {family!r} has no LLaVA model type (llava_llama / llava_mistral / llava_qwen)"
    if cfg.vision is None or cfg.projector is None:
        return "LLaVA's layout needs a vision tower and a projector"
    if not cfg.vision.spec.llava_original:
        return f"a {cfg.vision.kind} tower: LLaVA's CLIPVisionTower loads CLIP towers only"
    if isinstance(cfg.vision.vision_select_layer, (list, tuple)):
        return "several concatenated tower layers: LLaVA's mm_vision_select_layer is one layer"
    if cfg.projector.type in ("mlp_downsample", "mlp_pixel_shuffle") or not cfg.projector.bias:
        return f"projector {cfg.projector.type} (bias={cfg.projector.bias}): LLaVA builds linear / mlpNx_gelu with bias"
    if cfg.anyres is not None or cfg.video is not None:
        return "AnyRes / video: LLaVA-NeXT's settings, not written by this export (use neva-to-hf)"
    if cfg.llm.is_moe:
        return "an MoE decoder: LLaVA's classes have none"
    return None


def check_llava_layout(cfg: NevaConfig, what: str) -> None:
    """Refuse, naming ``what``, a model LLaVA's own layout cannot hold (the export's check; the support matrix's).

    Raises:
        ConfigError: with ``llava_refusal``'s reason.
    """
    reason = llava_refusal(cfg)
    if reason is not None:
        raise ConfigError(f"{what} cannot be written in LLaVA's own layout: {reason}")


def llava_key(key: str, projector_type: str) -> str:
    """LLaVA's key of a neva decoder / projector key (the tower's go to its own directory: ``tower_key``)."""
    part, rest = key.split(".", 1)
    if part == "llm":
        return "lm_head.weight" if rest == LM_HEAD else "model." + part_key_to_hf(rest, "llm")
    if part == "projector":
        # LLaVA's `linear` projector is a bare nn.Linear (`mm_projector.weight`); neva's is Sequential's layer 0.
        return LLAVA_ORIGINAL_PROJECTOR + (rest.removeprefix("0.") if projector_type == "linear" else rest)
    raise KeyError(key)


def tower_key(key: str) -> str:
    """``CLIPVisionModel``'s key of a neva tower key."""
    return "vision_model." + part_key_to_hf(key.removeprefix("vision."), "vision")


def llava_config(cfg: NevaConfig, tower: Path, meta: dict[str, Any], pad_token_id: int | None) -> dict[str, Any]:
    """LLaVA's ``config.json``: the decoder's HF config under LLaVA's model type, and the ``mm_*`` keys."""
    text = llava_config_dict(cfg, pad_token_id=pad_token_id)["text_config"]
    model_type, cls = decoder_spec(cfg.llm.family).llava
    v = cfg.vision
    return {
        **text,
        "model_type": model_type,
        "architectures": [cls],
        "mm_vision_tower": str(tower.resolve()),
        "mm_hidden_size": v.feature_size,
        "mm_projector_type": cfg.projector.type,
        "mm_vision_select_layer": v.vision_select_layer,
        "mm_vision_select_feature": v.vision_select_feature,
        "mm_patch_merge_type": "flat",
        "mm_use_im_start_end": False,
        "mm_use_im_patch_token": False,
        "mm_projector_lr": None,
        "image_aspect_ratio": meta.get("image_aspect_ratio") or "square",
        "tokenizer_padding_side": "right",
        "tokenizer_model_max_length": cfg.llm.max_seq_len,
        "tune_mm_mlp_adapter": False,
        "freeze_mm_mlp_adapter": False,
        "use_mm_proj": True,
        "use_cache": True,
    }


def drop_added_token(directory: Path, token: str) -> None:
    """Remove added token ``token`` from the tokenizer files in ``directory``: a LLaVA-original import's ``<image>``
    has no vocabulary row (LLaVA splices images at id -200), so LLaVA's tokenizer has no such token either."""

    def update(name: str, change: Any) -> None:
        path = directory / name
        if path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            change(data)
            path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    def config(data: dict[str, Any]) -> None:
        decoder = data.get("added_tokens_decoder") or {}
        data["added_tokens_decoder"] = {k: v for k, v in decoder.items() if v.get("content") != token}
        for key in ("additional_special_tokens", "extra_special_tokens"):
            if isinstance(data.get(key), list):
                data[key] = [t for t in data[key] if t != token]

    update("tokenizer_config.json", config)
    update("added_tokens.json", lambda data: data.pop(token, None))
    update("special_tokens_map.json", lambda data: config(data))
    update(
        "tokenizer.json",
        lambda data: data.update(added_tokens=[t for t in data["added_tokens"] if t["content"] != token]),
    )


def export_llava_original(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    projector_only: bool = False,
    decoder_only: bool = False,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write neva checkpoint ``ckpt`` in LLaVA's own layout.

    Args:
        ckpt: neva checkpoint directory.
        out: directory to create (atomically).
        projector_only: LLaVA's pretrain-stage output (``config.json`` + ``mm_projector.bin``) instead of the whole
            model.
        decoder_only: the decoder alone as a plain HF model (``LlamaForCausalLM`` ...): a LoRA export's
            ``model_base``.
        dtype: cast floating tensors; None keeps them.
        max_shard_bytes, overwrite: as the other exports.

    Raises:
        ConfigError: the model has no LLaVA-original form (``llava_refusal``).
    """
    cfg, meta = load_config(ckpt), load_metadata(ckpt)
    check_llava_layout(cfg, str(ckpt))
    tokenizer = load_tokenizer(ckpt)
    with atomic_directory(out, overwrite) as tmp:
        tower = Path(out) / TOWER_DIR
        config = llava_config(cfg, tower, meta, getattr(tokenizer, "pad_token_id", None))
        if decoder_only:
            config = llava_config_dict(cfg, pad_token_id=getattr(tokenizer, "pad_token_id", None))["text_config"]
            config.update(model_type=cfg.llm.family, architectures=[decoder_spec(cfg.llm.family).causal_lm])
        if dtype is not None:
            config["torch_dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tower_tensors, projector = {}, {}

        def decoder() -> Iterator[tuple[str, torch.Tensor]]:
            for key, tensor in iter_tensors(ckpt):
                tensor = cast_floating(tensor, dtype)
                if key.startswith("vision."):
                    tower_tensors[tower_key(key)] = tensor
                elif key.startswith("projector."):
                    projector[llava_key(key, cfg.projector.type)] = tensor
                    if not (projector_only or decoder_only):
                        yield llava_key(key, cfg.projector.type), tensor
                elif key == "llm." + LM_HEAD and cfg.llm.tie_word_embeddings:
                    continue
                elif not projector_only:
                    yield llava_key(key, cfg.projector.type), tensor

        if projector_only:
            for _ in decoder():
                pass
            torch.save({k: v.contiguous() for k, v in projector.items()}, tmp / PROJECTOR_FILE)
        else:
            write_safetensors(tmp, decoder(), max_shard_bytes)
            tokenizer.save_pretrained(str(tmp))
            make_tokenizer_4_readable(tmp)  # LLaVA's loader runs transformers 4.x
            merges_as_strings(tmp)
            if cfg.image_token_id >= cfg.llm.vocab_size:
                drop_added_token(tmp, IMAGE_TOKEN)
        if decoder_only:
            return Path(out)
        write_tower(cfg, tower_tensors, tmp / TOWER_DIR, max_shard_bytes)
    return Path(out)


def merges_as_strings(directory: Path) -> None:
    """A ``tokenizer.json``'s BPE merges as ``"a b"`` strings, the form tokenizers < 0.20 (LLaVA's pinned 0.15) reads,
    when no piece holds a space (then the two forms are the same merges)."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return
    data = json.loads(path.read_text(encoding="utf-8"))
    merges = (data.get("model") or {}).get("merges")
    if not merges or not isinstance(merges[0], list) or any(" " in a or " " in b for a, b in merges):
        return
    data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def write_tower(cfg: NevaConfig, tensors: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> None:
    """The tower as the ``CLIPVisionModel`` directory ``mm_vision_tower`` names: config, weights (``tower_key``
    names), image processor."""
    import transformers

    directory.mkdir()
    transformers.CLIPVisionConfig(**llava_config_dict(cfg)["vision_config"]).save_pretrained(str(directory))
    write_safetensors(directory, iter(tensors.items()), max_shard_bytes)
    tower_image_processor(cfg.vision).save_pretrained(str(directory))


def export_llava_lora(
    step: str | os.PathLike,
    out: str | os.PathLike,
    base_out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> tuple[Path, Path]:
    """A LoRA run's step checkpoint → LLaVA's LoRA layout in ``out`` (``config.json``, ``adapter_config.json``,
    ``adapter_model.bin``, ``non_lora_trainables.bin``: what trained besides LoRA) and its ``model_base`` in
    ``base_out`` (the decoder the adapters sit on, a plain HF model): ``load_pretrained_model(out, base_out, ...)``.

    Raises:
        ConfigError: the run trained without LoRA, or its model has no LLaVA layout.
    """
    import tempfile

    from neva.checkpoint.step import load_step_model
    from neva.models.lora import split_state_dict

    loaded = load_step_model(step)
    check_llava_layout(loaded.source.cfg, str(step))
    base, layers = split_state_dict(loaded.model)
    if not layers:
        raise ConfigError(f"{step}: the run trained without LoRA (model.peft.peft_scheme); use neva-to-llava")
    settings = {(m.lora_a.out_features, m.scale) for m in layers.values()}
    if len(settings) != 1:
        raise ConfigError(f"{step}: LoRA layers of different (rank, scale) {sorted(settings)}: not one adapter config")
    rank, scale = settings.pop()
    policy = loaded.cfg.model.trainable_policy()
    if policy.vision:
        raise ConfigError(f"{step}: a trained tower is not one of LLaVA's non-LoRA trainables (mm_projector)")
    projector_type = loaded.source.cfg.projector.type
    dtype_or = dtype or torch.float32
    with tempfile.TemporaryDirectory(prefix="neva-base-") as tmp:
        ckpt = loaded.save(Path(tmp) / "base", base, None, False)
        base_dir = export_llava_original(ckpt, base_out, decoder_only=True, dtype=dtype, overwrite=overwrite,
                                         max_shard_bytes=max_shard_bytes)  # fmt: skip
        with atomic_directory(out, overwrite) as target:
            arch = loaded.source.cfg
            config = llava_config(arch, Path(out) / TOWER_DIR, load_metadata(ckpt), None)
            (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            tower = {tower_key(k): cast_floating(v, dtype) for k, v in base.items() if k.startswith("vision.")}
            write_tower(arch, tower, target / TOWER_DIR, max_shard_bytes)
            adapter = {}
            for name, layer in sorted(layers.items()):
                module = "base_model.model." + llava_key(f"{name}.weight", projector_type).removesuffix(".weight")
                adapter[f"{module}.lora_A.weight"] = layer.lora_a.weight.detach().to(dtype_or).contiguous()
                adapter[f"{module}.lora_B.weight"] = layer.lora_b.weight.detach().to(dtype_or).contiguous()
            torch.save(adapter, target / "adapter_model.bin")
            targets = sorted({key.split(".lora_")[0].rsplit(".", 1)[1] for key in adapter})
            adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scale * rank,
                              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
                              "modules_to_save": None, "base_model_name_or_path": str(Path(base_out).resolve()),
                              "target_modules": targets}  # fmt: skip
            (target / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
            non_lora = {"base_model.model." + llava_key(k, projector_type): v.detach().to(dtype_or).contiguous()
                        for k, v in base.items() if k.startswith("projector.")}  # fmt: skip
            torch.save(non_lora, target / "non_lora_trainables.bin")
    return Path(out), base_dir
