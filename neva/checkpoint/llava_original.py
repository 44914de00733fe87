"""LLaVA's own checkpoints (haotian-liu/LLaVA's ``llava_llama``, LLaVA-NeXT's ``llava_mistral`` / ``llava_qwen``) →
neva checkpoints that train and serve as LLaVA's trainer does, AnyRes (LLaVA-1.6, LLaVA-OneVision) included.

transformers knows none of these model types, so ``config.json`` is read as it is: its ``mm_*`` keys are each mapped
or refused (``MM_KEYS``), the rest is the decoder's config, handed to ``llm_config_from_hf`` under the family's own
model type. The vision tower is the one ``mm_vision_tower`` names (a local directory; a Hub id only when its snapshot
is in the local HF cache); its weights are that directory's, as LLaVA's loader takes them, unless the config says the
tower was trained (``unfreeze_mm_vision_tower``, ``mm_tunable_parts``): then LLaVA loads the ones saved in the
checkpoint (``model.vision_tower.vision_tower.*``), and so does the import. The projector is ``model.mm_projector.*``
in the weights, or the pretrain stage's ``mm_projector.bin`` beside them.

AnyRes (``image_aspect_ratio: anyres`` / ``anyres_max_N``) becomes ``NevaConfig.anyres`` (``anyres_config``):
LLaVA-NeXT's code reads ``image_grid_pinpoints`` as ``(width, height)`` pairs and truncates in ``unpad_image``, so the
pairs are swapped into neva's ``(height, width)`` in their order (ties go to the first) and ``unpad_truncate`` is set.

Exactness (docs/INTEROP.md): LLaVA splices images at id -200 and its vocabulary has no ``<image>`` row; the import
adds ``<image>`` to the tokenizer only (``image_token_id == vocab_size``: no embedding or LM-head row, so the softmax
has LLaVA's classes), pads with ``<unk>`` as LLaVA's trainer does, and records ``tokenization: llava`` (LLaVA's
``tokenizer_image_token`` ids) and the checkpoint's ``image_aspect_ratio``.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint.hf_config import llm_config_from_hf, vision_config_from_hf
from neva.checkpoint.hf_keys import LLAVA_ORIGINAL_PROJECTOR, detect_prefixes
from neva.checkpoint.hf_read import (
    cast_floating,
    check_complete,
    has_tokenizer,
    hf_tensor_shapes,
    hf_weight_files,
    iter_hf_tensors,
    load_hf_config,
    map_keys,
    read_projector_file,
    with_image_stats,
)
from neva.checkpoint.llava_lora import NON_LORA, LlavaLora, is_llava_lora, read_llava_lora
from neva.checkpoint.neva_format import save_checkpoint
from neva.checkpoint.safetensors_io import DEFAULT_MAX_SHARD_BYTES
from neva.constants import IMAGE_TOKEN
from neva.families import DECODERS, MERGERS
from neva.hf_local import LocalModelError, model_dir
from neva.models.anyres import MERGE_TYPES, AnyResConfig, parse_aspect_ratio, parse_grid_pinpoints
from neva.models.config import NevaConfig, ProjectorConfig, VisionConfig
from neva.typed import ConfigError

# LLaVA model type → the decoder family whose HF config the rest of config.json is.
LLAVA_MODEL_TYPES = {spec.llava[0]: name for name, spec in DECODERS.items() if spec.llava}
# LLaVA-OneVision's released config.json says ``model_type: llava`` (llava-hf's type) with LLaVA-NeXT's architecture
# names and ``mm_*`` keys (a llava-hf config has ``vision_config``, never ``mm_vision_tower``).
LLAVA_ARCHITECTURES = {
    "LlavaLlamaForCausalLM": "llava_llama",
    "LlavaMistralForCausalLM": "llava_mistral",
    "LlavaQwenForCausalLM": "llava_qwen",
}
PROJECTOR_FILE = "mm_projector.bin"  # what LLaVA's pretrain stage (tune_mm_mlp_adapter) saves
_TOWER_PREFIX = "model.vision_tower."  # tower weights a checkpoint may hold, loaded only if trained (tower_trained)

# Every multimodal key of a LLaVA config.json: how the import treats it. "map": read below; "ignore": training
# bookkeeping that changes nothing a neva checkpoint holds; a tuple: the only values the import accepts (else refused).
MM_KEYS: dict[str, Any] = {
    "mm_vision_tower": "map",
    "mm_hidden_size": "map",  # checked against the tower's feature size
    "mm_projector_type": "map",
    "mm_vision_select_layer": "map",
    "mm_vision_select_feature": "map",
    "image_aspect_ratio": "map",  # square, pad; anyres, anyres_max_N: NevaConfig.anyres (anyres_config)
    "mm_patch_merge_type": "map",  # flat; with AnyRes also spatial, spatial_unpad
    "image_grid_pinpoints": "map",  # AnyRes's candidate grids
    "unfreeze_mm_vision_tower": "map",  # the tower was trained: its weights are the checkpoint's
    "mm_tunable_parts": "map",  # LLaVA-NeXT's spelling of the same ("mm_vision_tower,mm_mlp_adapter,...")
    "mm_use_im_start_end": (False,),
    "mm_use_im_patch_token": (False, True),  # a row LLaVA adds for <im_patch> is in the weights; never emitted
    "image_crop_resolution": "ignore",  # read only by image_aspect_ratio crop_split (refused)
    "image_split_resolution": "ignore",
    "image_token_index": "ignore",  # LLaVA splices images at id -200 whatever id this records
    "freeze_mm_vision_resampler": "ignore",
    "tune_mm_vision_resampler": "ignore",
    "pos_skipping_range": "ignore",  # read only under use_pos_skipping (refused)
    "use_pos_skipping": (False, None),  # random position-id offsets in training: not neva's positions
    "vision_tower_pretrained": (None, ""),
    "mm_projector_lr": "ignore",
    "mm_vision_tower_lr": "ignore",
    "tune_mm_mlp_adapter": "ignore",
    "freeze_mm_mlp_adapter": "ignore",
    "use_mm_proj": "ignore",
    "tokenizer_padding_side": "ignore",
    "tokenizer_model_max_length": "ignore",
    "mm_resampler_type": (None,),
    # Read only for video inputs (LLaVA-NeXT's prepare_inputs_labels_for_multimodal, modality "video"): the image
    # model imports as it is and the video path does not (a warning says so; LLaVA-NeXT pools video features after
    # the projector, neva's NevaConfig.video before it, docs/INTEROP.md "Video").
    "mm_spatial_pool_mode": "video",
    "mm_spatial_pool_stride": "video",
    "mm_newline_position": "video",
    "add_faster_video": "video",
    "faster_token_stride": "video",
}


def read_llava_config(directory: str | os.PathLike) -> dict[str, Any] | None:
    """A LLaVA-original ``config.json`` as it is, or None when the directory is not one (another model type)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return None
    return llava_config(json.loads(path.read_text()))


def llava_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """A ``config.json`` dict with its LLaVA model type settled, or None when it is not a LLaVA-original one (the
    support matrix asks this too, on configs it writes)."""
    kind = config.get("model_type")
    if kind == "llava" and "mm_vision_tower" in config:
        kind = next(
            (LLAVA_ARCHITECTURES[a] for a in config.get("architectures") or [] if a in LLAVA_ARCHITECTURES), None
        )
    return {**config, "model_type": kind} if kind in LLAVA_MODEL_TYPES else None


def not_llava(source: str | os.PathLike) -> ConfigError:
    """The refusal of a config whose model type LLaVA-original import does not read."""
    return ConfigError(f"{source}: config.json model_type is not one of {sorted(LLAVA_MODEL_TYPES)}")


def split_llava_config(config: dict[str, Any], source: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(decoder config dict with defaults filled, multimodal keys)``; a multimodal setting neva cannot reproduce is
    refused naming the key.

    Raises:
        ConfigError: an unknown ``mm_*`` key, or a value outside ``MM_KEYS``' accepted ones.
    """
    from transformers import AutoConfig

    family = LLAVA_MODEL_TYPES[config["model_type"]]
    mm = {k: v for k, v in config.items() if k in MM_KEYS or k.startswith("mm_")}
    for key, value in mm.items():
        rule = MM_KEYS.get(key)
        if rule is None:
            raise ConfigError(f"{source}: config.json key {key}={value!r} is not known to neva's LLaVA import")
        if isinstance(rule, tuple) and value not in rule:
            raise ConfigError(f"{source}: config.json {key}={value!r} is not supported (neva reproduces {list(rule)})")
    video = {k: v for k, v in mm.items() if MM_KEYS.get(k) == "video" and v not in (None, False)}
    if video:
        warnings.warn(
            f"{source}: config.json {video} configure LLaVA-NeXT's video path, which is not imported: the image model "
            "is (neva's video models pool before the projector, LLaVA-NeXT's after it)",
            stacklevel=3,
        )
    text = {k: v for k, v in config.items() if k not in mm and k not in ("model_type", "architectures", "auto_map")}
    # transformers' defaults of the decoder family, as AutoConfig fills them for a plain checkpoint of that family.
    return AutoConfig.for_model(family, **text).to_dict(), mm


def anyres_config(mm: dict[str, Any], image_size: int, source: str | os.PathLike) -> AnyResConfig | None:
    """LLaVA-NeXT's AnyRes keys as an ``AnyResConfig`` (None for ``square`` / ``pad`` images), with its own reading
    of the pinpoints (``(width, height)``: swapped into neva's ``(height, width)``, order kept) and of
    ``unpad_image`` (``unpad_truncate``); what neva does not lay out as LLaVA-NeXT does is refused by key.

    Raises:
        ConfigError: another ``image_aspect_ratio`` (``highres``, ``crop_split``, ...), an ``mm_patch_merge_type``
            other than flat / spatial / spatial_unpad (``maxpool2x2``, ``nobase`` variants), a spatial layout
            without AnyRes, AnyRes without ``image_grid_pinpoints``.
    """
    aspect = mm.get("image_aspect_ratio", "square")
    merge = mm.get("mm_patch_merge_type", "flat")
    if aspect in ("square", "pad"):
        if merge != "flat":
            raise ConfigError(
                f"{source}: config.json mm_patch_merge_type={merge!r} with image_aspect_ratio={aspect!r} is not "
                "supported (neva lays out only AnyRes images spatially; with square / pad images it reproduces flat)"
            )
        return None
    max_num_patches = parse_aspect_ratio(aspect)
    if aspect != "anyres" and max_num_patches is None:
        raise ConfigError(
            f"{source}: config.json image_aspect_ratio={aspect!r} is not supported (neva reproduces square, pad, "
            "anyres, anyres_max_N)"
        )
    if merge not in MERGE_TYPES:
        raise ConfigError(
            f"{source}: config.json mm_patch_merge_type={merge!r} is not supported with image_aspect_ratio={aspect!r} "
            f"(neva reproduces {list(MERGE_TYPES)})"
        )
    pins = mm.get("image_grid_pinpoints")
    if pins is None:
        raise ConfigError(f"{source}: config.json image_aspect_ratio={aspect!r} needs image_grid_pinpoints")
    if isinstance(pins, str) and "x" not in pins:
        pins = ast.literal_eval(pins)  # LLaVA-NeXT's other string form: a list literal
    try:
        pairs = parse_grid_pinpoints(pins, image_size)  # LLaVA-NeXT's order, each pair (width, height)
        return AnyResConfig(
            grid_pinpoints=[[h, w] for w, h in pairs],
            patch_merge_type=merge,
            max_num_patches=max_num_patches,
            unpad_truncate=True,
        )
    except ValueError as err:
        raise ConfigError(f"{source}: config.json: {err}") from None


def tower_trained(mm: dict[str, Any]) -> bool:
    """Whether LLaVA loads the tower weights saved in the checkpoint: it built the tower before loading them when
    the tower was trained (haotian-liu/LLaVA: ``unfreeze_mm_vision_tower``; LLaVA-NeXT: ``mm_tunable_parts``)."""
    parts = mm.get("mm_tunable_parts") or ""
    return bool(mm.get("unfreeze_mm_vision_tower")) or "mm_vision_tower" in parts.split(",")


def llava_next_siglip(
    vision: VisionConfig, mm: dict[str, Any], shapes: dict[str, Any], source: str | os.PathLike
) -> VisionConfig:
    """A SigLIP tower as LLaVA-NeXT's ``SigLipVisionTower`` runs it: it deletes the tower's last layer and takes the
    output of the one before (``hidden_states[-1]`` of the shortened tower, ``-2`` of the whole one) whatever
    ``mm_vision_select_layer`` says, and a trained tower is saved so shortened. ``shapes``: the tower weights the
    import reads (the checkpoint's or the directory's); a CLIP tower is returned as it is.

    Raises:
        ConfigError: SigLIP weights that hold neither the whole tower nor the one shortened by its last layer.
    """
    if not vision.spec.llava_next_shortened:
        return vision
    if mm.get("mm_vision_select_layer", -2) != -2:
        warnings.warn(
            f"{source}: config.json mm_vision_select_layer={mm['mm_vision_select_layer']} on a SigLIP tower: "
            "LLaVA-NeXT's SigLipVisionTower ignores it and takes the output of the second-to-last layer, and so does "
            "the import",
            stacklevel=3,
        )
    layers = {int(m.group(1)) for k in shapes if (m := re.search(r"encoder\.layers\.(\d+)\.", k))}
    saved = max(layers) + 1 if layers else 0
    if saved == vision.num_layers - 1:
        return dataclasses.replace(vision, num_layers=saved, vision_select_layer=-1)
    if saved != vision.num_layers:
        raise ConfigError(
            f"{source}: the SigLIP tower weights hold {saved} layers, its config {vision.num_layers} (LLaVA-NeXT saves "
            f"{vision.num_layers - 1})"
        )
    return dataclasses.replace(vision, vision_select_layer=-2)


def projector_config(mm: dict[str, Any], feature_size: int, hidden_size: int, source: str | os.PathLike):
    """LLaVA's ``mm_projector_type`` (``linear``, ``mlp{N}x_gelu``, ``identity``) as a ``ProjectorConfig``."""
    kind = mm.get("mm_projector_type", "linear")
    others = {"mlp_downsample": "NeMo", "mlp_pixel_shuffle": "InternVL"}  # ProjectorConfig types LLaVA never builds
    if kind in others or kind in MERGERS:
        what = f"{others[kind]}'s projector" if kind in others else f"the {MERGERS[kind].kind} tower's merger"
        raise ConfigError(
            f"{source}: mm_projector_type={kind!r} is {what}, not one LLaVA builds (linear, identity, mlp<N>x_gelu)"
        )
    if mm.get("mm_hidden_size", feature_size) != feature_size:
        raise ConfigError(
            f"{source}: mm_hidden_size={mm['mm_hidden_size']} but the vision tower's selected features have "
            f"{feature_size} channels"
        )
    try:
        return ProjectorConfig(type=kind, input_size=feature_size, output_size=hidden_size)
    except ValueError as err:
        raise ConfigError(f"{source}: mm_projector_type={kind!r}: {err}") from None


def tower_dir(mm: dict[str, Any], vision: str | os.PathLike | None, source: str | os.PathLike) -> Path:
    """The vision tower's local directory: ``vision`` if given, else the one ``mm_vision_tower`` names."""
    name = vision if vision is not None else mm.get("mm_vision_tower")
    if name is None:
        raise ConfigError(f"{source}: config.json has no mm_vision_tower; pass the tower directory (--vision)")
    try:
        return Path(model_dir(name))
    except LocalModelError as err:
        raise LocalModelError(
            f"{source}: mm_vision_tower: {err} Or pass the tower directory as --vision DIR."
        ) from None


def import_llava_original(
    directory: str | os.PathLike,
    out: str | os.PathLike,
    *,
    vision: str | os.PathLike | None = None,
    llm: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    metadata: dict[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    base: str | os.PathLike | None = None,
) -> Path:
    """Convert a LLaVA-original directory to a neva checkpoint.

    Args:
        directory: LLaVA's output: ``config.json`` (``llava_llama`` / ``llava_mistral`` / ``llava_qwen``) with the
            decoder weights and ``model.mm_projector.*``, or a pretrain stage's ``config.json`` + ``mm_projector.bin``.
        out: neva checkpoint directory to create.
        vision: the vision tower's directory, overriding ``mm_vision_tower`` (which often names a Hub id).
        llm: the decoder's HF directory when ``directory`` holds no decoder weights (a pretrain stage's output).
        dtype, metadata, max_shard_bytes, overwrite: as ``import_llava``.
        base: a LoRA run's ``model_base`` (``llava_lora``: ``directory`` holds ``adapter_config.json``), whose
            weights the adapter and ``non_lora_trainables.bin`` are merged into, as LLaVA's ``load_pretrained_model``
            does; its tokenizer is the one used.

    Returns:
        ``out``.

    Raises:
        ConfigError: not a LLaVA-original config, an unsupported ``mm_*`` setting, missing decoder or projector
            weights, a tokenizer that does not fit the vocabulary.
        ValueError: tensors that map nowhere or are missing (the HF import's checks).
        LocalModelError: the tower (or decoder) is not a local directory; the message says what to pass.
    """
    directory = Path(model_dir(directory))
    config = read_llava_config(directory)
    if config is None:
        raise not_llava(directory)
    text, mm = split_llava_config(config, directory)
    vision_dir = tower_dir(mm, vision, directory)
    vision_cfg = vision_config_from_hf(
        load_hf_config(vision_dir), mm.get("mm_vision_select_layer", -1), mm.get("mm_vision_select_feature", "patch")
    )
    llm_cfg = llm_config_from_hf(text)
    projector = projector_config(mm, vision_cfg.feature_size, llm_cfg.hidden_size, directory)

    lora = None
    if is_llava_lora(directory):
        if base is None:
            raise ConfigError(f"{directory} is a LoRA checkpoint (adapter_config.json): pass the model it adapts, "
                              "LLaVA's model_base (--base DIR, e.g. vicuna-7b-v1.5)")  # fmt: skip
        lora = read_llava_lora(directory)
        llm = base
    elif base is not None:
        raise ConfigError(f"--base goes with a LoRA checkpoint (adapter_config.json), and {directory} holds none")
    has_llm = lora is None and _has_weights(directory)
    llm_dir = directory if has_llm else Path(model_dir(llm)) if llm is not None else None
    if llm_dir is None:
        raise ConfigError(f"{directory} holds no decoder weights (a pretrain stage's output): pass the decoder's HF "
                          "directory (--llm DIR)")  # fmt: skip
    llm_shapes = hf_tensor_shapes(llm_dir)
    # The tower's weights: the checkpoint's when LLaVA loads those (tower_trained), else mm_vision_tower's directory.
    saved_tower = {k: s for k, s in llm_shapes.items() if k.startswith(_TOWER_PREFIX)}
    tower_from_ckpt = has_llm and tower_trained(mm)
    if tower_from_ckpt and not saved_tower:
        raise ConfigError(
            f"{directory}: config.json says the vision tower was trained (unfreeze_mm_vision_tower / "
            f"mm_tunable_parts) but the weights hold no {_TOWER_PREFIX}* tensors"
        )
    vision_src = llm_dir if tower_from_ckpt else vision_dir
    vision_shapes = saved_tower if tower_from_ckpt else hf_tensor_shapes(vision_dir)
    vision_cfg = llava_next_siglip(vision_cfg, mm, vision_shapes, directory)
    tok_dir = directory if has_tokenizer(directory) and lora is None else llm_dir  # LoRA: model_base's (builder.py)
    tokenizer = _llava_tokenizer(tok_dir, llm_cfg.vocab_size)
    cfg = NevaConfig(
        llm=llm_cfg,
        vision=vision_cfg,
        projector=projector,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        anyres=anyres_config(mm, vision_cfg.image_size, directory),
    )
    cfg = with_image_stats(cfg, vision_dir)

    llm_shapes = {k: s for k, s in llm_shapes.items() if not k.startswith(_TOWER_PREFIX)}
    vision_map = map_keys(list(vision_shapes), detect_prefixes(list(vision_shapes), parts=("vision",)), vision_src)
    parts = ("llm", "projector") if has_llm else ("llm",)
    llm_map = map_keys(list(llm_shapes), detect_prefixes(list(llm_shapes), parts=parts), llm_dir)
    projector_file = None
    if lora is not None:
        projector_tensors, replaced = _non_lora_tensors(lora, llm_map, directory)
        _check_deltas(lora, llm_shapes, directory)
    elif not any(name.startswith("projector.") for name in llm_map.values()):
        projector_file = directory / PROJECTOR_FILE
        if not projector_file.is_file():
            raise ConfigError(f"{directory}: no model.mm_projector.* weights and no {PROJECTOR_FILE}")
    if lora is None:
        projector_tensors = read_projector_file(projector_file) if projector_file is not None else {}
        replaced = {}
    produced = {vision_map[k]: vision_shapes[k] for k in vision_map}
    produced.update({llm_map[k]: llm_shapes[k] for k in llm_map})
    produced.update({k: tuple(t.shape) for k, t in projector_tensors.items()})
    check_complete(cfg, produced, f"{directory} + {vision_dir}")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        if not tower_from_ckpt:
            for key, tensor in iter_hf_tensors(vision_dir):
                if key in vision_map:
                    yield vision_map[key], cast_floating(tensor, dtype)
        for key, tensor in iter_hf_tensors(llm_dir):
            name = llm_map.get(key) or (vision_map.get(key) if tower_from_ckpt else None)
            if name is None:
                continue
            tensor = replaced.get(key, tensor)
            if lora is not None and key in lora.deltas:  # PEFT's merge, in fp32, back to the weight's dtype
                tensor = (tensor.float() + lora.deltas[key]).to(tensor.dtype)
            yield name, cast_floating(tensor, dtype)
        for key, tensor in projector_tensors.items():
            yield key, cast_floating(tensor, dtype)

    source = {"kind": "llava-original", "path": str(directory), "vision": str(vision_dir)}
    if tower_from_ckpt:
        source["vision_weights"] = str(directory)
    if not has_llm:
        source["llm"] = str(llm_dir)
    if lora is not None:
        source.update(kind="llava-original-lora", lora_rank=lora.rank, lora_alpha=lora.alpha)
    meta = {"source": source, "tokenization": "llava", "image_aspect_ratio": mm.get("image_aspect_ratio",
            "square"), **(metadata or {})}  # fmt: skip
    if "conv_template" not in meta:
        warnings.warn(
            f"{directory}: LLaVA's config.json does not record its conversation template and no --conv-template was "
            "given: neva.generate will render prompts as vicuna_v1 (LLaVA-1.5's v1)",
            stacklevel=2,
        )
    return save_checkpoint(
        out, cfg, tensors(), tokenizer, max_shard_bytes=max_shard_bytes, metadata=meta, overwrite=overwrite
    )


def _non_lora_tensors(
    lora: LlavaLora, llm_map: dict[str, str], directory: Path
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``non_lora_trainables.bin`` split as LLaVA's ``load_state_dict(strict=False)`` places it: the projector
    (neva keys), and base tensors it replaces (HF keys). A key neither is refused (LLaVA would drop it silently)."""
    projector_keys = [k for k in lora.non_lora if k.startswith(LLAVA_ORIGINAL_PROJECTOR)]
    mapping = map_keys(projector_keys, detect_prefixes(projector_keys, parts=("projector",)), directory / NON_LORA)
    other = [k for k in lora.non_lora if k not in mapping and k not in llm_map]
    if other:
        raise ConfigError(f"{directory / NON_LORA}: {len(other)} tensor(s) that are neither the projector nor the "
                          f"base model's, e.g. {other[:3]}")  # fmt: skip
    if not mapping:
        raise ConfigError(f"{directory}: no model.mm_projector.* tensors in {NON_LORA}")
    replaced = {k: v for k, v in lora.non_lora.items() if k in llm_map}
    return {mapping[k]: lora.non_lora[k] for k in mapping}, replaced


def _check_deltas(lora: LlavaLora, llm_shapes: dict[str, tuple[int, ...]], directory: Path) -> None:
    """Every adapter sits on a base weight of its shape (else the merge would drop it or fail mid-write)."""
    for key, delta in lora.deltas.items():
        if key not in llm_shapes:
            raise ConfigError(f"{directory}: the adapter of {key} has no weight in the base model")
        if tuple(llm_shapes[key]) != tuple(delta.shape):
            raise ConfigError(f"{directory}: the adapter of {key} is {tuple(delta.shape)}, the base weight "
                              f"{tuple(llm_shapes[key])}")  # fmt: skip


def _has_weights(directory: Path) -> bool:
    try:
        hf_weight_files(directory)
    except FileNotFoundError:
        return False
    return True


def _llava_tokenizer(directory: Path, vocab_size: int) -> Any:
    """The checkpoint's tokenizer with ``<image>`` added after the vocabulary (no row) and LLaVA's ``<unk>`` padding.

    Raises:
        ConfigError: the tokenizer is larger than the model's vocabulary.
    """
    from neva.data.sentencepiece_tokenizer import load_tokenizer as load_hf_tokenizer

    tokenizer = load_hf_tokenizer(directory)
    if len(tokenizer) > vocab_size:
        raise ConfigError(f"{directory}: tokenizer has {len(tokenizer)} tokens, the model's vocabulary {vocab_size}")
    if tokenizer.pad_token is None and tokenizer.unk_token is not None:
        tokenizer.pad_token = tokenizer.unk_token  # train.py: tokenizer.pad_token = tokenizer.unk_token
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"extra_special_tokens": [IMAGE_TOKEN]}, replace_extra_special_tokens=False)
    return tokenizer
