"""Qwen-VL directories (``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``,
``Qwen3VLForConditionalGeneration``, ``Qwen3VLMoeForConditionalGeneration``) ↔ neva checkpoints: config, weights, tokenizer, pixel budget and chat template.

A Qwen-VL model is neva's parts under other names: a native-resolution tower (``VisionConfig.kind``), its patch
merger as the projector (with Qwen3-VL's DeepStack mergers, whose features join the first decoder layers:
``neva.models.deepstack``), and a Qwen2 or Qwen3 decoder with M-RoPE (``LLMConfig.mrope_section``; Qwen3-VL's
interleaved layout, which its HF class always uses, whatever ``rope_parameters.mrope_interleaved`` says). Qwen3-VL-MoE's
decoder is the ``qwen3_moe`` family on neva's MoE layer: its stacked experts (``mlp.experts.gate_up_proj`` /
``down_proj``, router ``mlp.gate``) are read and written in transformers 5's layout through ``hf_moe``. The tower's and merger's keys
are ``hf_qwen_vl_keys``' table, the decoder's the LLM table every family shares (under transformers 5's
``model.language_model.`` or 4.x's ``model.``). Both config layouts are read: transformers 5's nested ``text_config``
and the hub's flat 4.x one (text fields at the top, ``rope_scaling.mrope_section``). The processor's ``min_pixels`` /
``max_pixels`` travel as checkpoint metadata, so serving resizes as the model was trained.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint.atomic import atomic_directory
from neva.checkpoint.hf_config import llm_config_from_hf
from neva.checkpoint.hf_families import hf_family_fields
from neva.checkpoint.hf_files import (
    export_dtype,
    template_settings,
    write_tokenizer_and_generation,
)
from neva.checkpoint.hf_import import ImportedParts
from neva.checkpoint.hf_keys import LM_HEAD, part_key_from_hf, part_key_to_hf
from neva.checkpoint.hf_linear_attention import fuse_tensors, split_shapes, split_tensors
from neva.checkpoint.hf_moe import stacked_tensors
from neva.checkpoint.hf_qwen_vl_keys import hf_key_to_neva as visual_key_to_neva
from neva.checkpoint.hf_qwen_vl_keys import neva_key_to_hf as visual_key_to_hf
from neva.checkpoint.hf_read import cast_floating, check_complete, has_tokenizer, hf_tensor_shapes, iter_hf_tensors
from neva.checkpoint.interop import Interop, round_trip_through
from neva.checkpoint.neva_format import (
    TensorSource,
    iter_tensors,
    load_config,
    load_metadata,
    save_checkpoint,
    tensor_pairs,
)
from neva.checkpoint.safetensors_io import DEFAULT_MAX_SHARD_BYTES, write_safetensors
from neva.data.qwen_images import QwenImageSpec
from neva.data.templates.qwen_vl import QWEN_IMAGE_PAD
from neva.hf_local import model_dir
from neva.models.config import LLMConfig, NevaConfig, ProjectorConfig, VisionConfig
from neva.typed import ConfigError


@dataclass(frozen=True)
class QwenVL:
    """One transformers Qwen-VL class: the neva parts it is made of and the classes an export names."""

    model_type: str
    tower: str  # VisionConfig.kind
    merger: str  # ProjectorConfig.type
    template: str  # neva.data.conversation template
    text_family: str  # LLMConfig.family of its decoder
    config_class: str
    model_class: str
    # Qwen3-VL: interleaved M-RoPE, and the section HF's rotary falls back to when the config names none.
    mrope_interleaved: bool = False
    default_mrope_section: tuple[int, int, int] | None = None


QWEN_VL = {
    row.model_type: row
    for row in (
        QwenVL("qwen2_vl", "qwen2_vl", "qwen2_vl_merger", "qwen2_vl", "qwen2",
               "Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
        QwenVL("qwen2_5_vl", "qwen2_5_vl", "qwen2_5_vl_merger", "qwen2_vl", "qwen2",
               "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
        QwenVL("qwen3_vl", "qwen3_vl", "qwen3_vl_merger", "qwen3_vl", "qwen3",
               "Qwen3VLConfig", "Qwen3VLForConditionalGeneration", True, (24, 20, 20)),
        QwenVL("qwen3_vl_moe", "qwen3_vl", "qwen3_vl_merger", "qwen3_vl", "qwen3_moe",
               "Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", True, (24, 20, 20)),
        # Qwen3.5: Qwen3-VL's tower without DeepStack, a hybrid decoder (neva/models/gated_deltanet.py)
        QwenVL("qwen3_5", "qwen3_vl", "qwen3_vl_merger", "qwen3_vl", "qwen3_5",
               "Qwen3_5Config", "Qwen3_5ForConditionalGeneration", True, (11, 11, 10)),
        QwenVL("qwen3_5_moe", "qwen3_vl", "qwen3_vl_merger", "qwen3_vl", "qwen3_5_moe",
               "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", True, (11, 11, 10)),
    )
}  # fmt: skip
NOT_YET: dict[str, str] = {}
# A neva model's row: its tower kind and its decoder's family (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE).
_BY_TOWER = {(row.tower, row.text_family): row for row in QWEN_VL.values()}
# Keys of a hub checkpoint that transformers' classes do not load (Qwen3.5's multi-token-prediction head).
_UNUSED_PREFIXES = ("mtp.",)
# Top-level fields of a Qwen-VL config that are not its decoder's (the 4.x layout keeps the decoder's at the top too).
_VL_FIELDS = (
    "vision_config", "text_config", "image_token_id", "video_token_id", "vision_start_token_id",
    "vision_end_token_id", "vision_token_id", "model_type", "architectures",
)  # fmt: skip
LLM_PREFIXES = ("model.language_model.", "model.")  # transformers 5, then 4.x (hub checkpoints)
LM_HEAD_KEY = "lm_head.weight"


def is_qwen_vl(hf: dict[str, Any]) -> bool:
    """Whether an HF ``config.json`` dict is a Qwen-VL model (imported here, not by the llava-hf path)."""
    return hf.get("model_type") in QWEN_VL or hf.get("model_type") in NOT_YET


def is_qwen_vl_checkpoint(ckpt: str | os.PathLike) -> bool:
    """Whether a neva checkpoint holds a Qwen-VL model (its tower is one ``QWEN_VL`` row's)."""
    cfg = load_config(ckpt)
    return cfg.vision is not None and (cfg.vision.kind, cfg.llm.family) in _BY_TOWER


def family_of(hf: dict[str, Any]) -> QwenVL:
    model_type = hf.get("model_type")
    if model_type in NOT_YET:
        raise ConfigError(f"model_type {model_type!r} is not supported yet ({NOT_YET[model_type]})")
    return QWEN_VL[model_type]


def neva_config_from_qwen_vl(hf: dict[str, Any]) -> NevaConfig:
    """NevaConfig of a Qwen-VL ``config.json`` dict (transformers 5 nested or 4.x flat layout)."""
    family = family_of(hf)
    llm = _llm_config(hf, family)
    vision, out_width = _vision_config(hf["vision_config"], family.tower)
    if out_width != llm.hidden_size:
        raise ConfigError(f"vision_config merger width {out_width} != the decoder's hidden_size {llm.hidden_size}")
    projector = ProjectorConfig(
        type=family.merger,
        input_size=vision.hidden_size,
        output_size=llm.hidden_size,
        spatial_merge_size=vision.spatial_merge_size,
        deepstack_mergers=len(vision.deepstack_visual_indexes),
    )
    # The video token makes the model take video (``NevaConfig.patch_video``).
    video_token_id = hf.get("video_token_id", hf.get("text_config", {}).get("video_token_id"))
    return NevaConfig(
        llm=llm, vision=vision, projector=projector, image_token_id=hf["image_token_id"], video_token_id=video_token_id
    )


def _llm_config(hf: dict[str, Any], family: QwenVL) -> LLMConfig:
    if "text_config" in hf:
        text = dict(hf["text_config"])
        text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    else:
        text = {k: v for k, v in hf.items() if k not in _VL_FIELDS}
    rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
    section = rope.pop("mrope_section", family.default_mrope_section)
    rope.pop("mrope_interleaved", None)  # the family's layout (the HF class reads no flag)
    rotary = float(rope.pop("partial_rotary_factor", text.pop("partial_rotary_factor", 1.0)))
    if section is None:
        raise ConfigError(f"{family.model_type} text config without rope mrope_section: not an M-RoPE decoder")
    rope.pop("type", None)  # "mrope" (or "default" after transformers 4.x rewrote it): the section says it
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"{family.model_type} rope_type {rope['rope_type']!r}: only default M-RoPE is implemented")
    text["rope_parameters"] = rope
    text["model_type"] = family.text_family
    llm = llm_config_from_hf(text, "text_config")
    try:
        return dataclasses.replace(
            llm, mrope_section=list(section), mrope_interleaved=family.mrope_interleaved, rotary_percent=rotary
        )
    except ValueError as err:  # a section the decoder cannot split its frequencies by: the file's value, refused
        raise ConfigError(f"{family.model_type} text config rope mrope_section: {err}") from None


def _vision_config(v: dict[str, Any], kind: str) -> tuple[VisionConfig, int]:
    """The tower of an HF Qwen vision config dict, and the width its merger writes."""
    common = dict(
        kind=kind,
        num_layers=v["depth"],
        num_heads=v["num_heads"],
        patch_size=v.get("patch_size", 14),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        num_channels=v.get("in_channels", v.get("in_chans", 3)),
        hidden_act=v["hidden_act"],
    )
    if kind == "qwen2_vl":  # embed_dim is the tower's width, hidden_size the merger's output
        width = v["embed_dim"]
        vision = VisionConfig(hidden_size=width, intermediate_size=int(width * v["mlp_ratio"]), **common)
        return vision, v["hidden_size"]
    if kind == "qwen3_vl":
        extra = dict(
            num_position_embeddings=v["num_position_embeddings"],
            deepstack_visual_indexes=list(v.get("deepstack_visual_indexes", [])),
        )
    else:
        extra = dict(
            window_size=v["window_size"],
            fullatt_block_indexes=list(v["fullatt_block_indexes"]),
            tokens_per_second=v.get("tokens_per_second"),
        )
    vision = VisionConfig(hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"], **common, **extra)
    return vision, v["out_hidden_size"]


def hf_key_to_neva(key: str, kind: str) -> str | None:
    """neva key of a Qwen-VL tensor (None: a key neva does not keep, e.g. rotary buffers)."""
    if key == LM_HEAD_KEY:
        return "llm." + LM_HEAD
    visual = visual_key_to_neva(key, kind)
    if visual is not None:
        return visual
    for prefix in LLM_PREFIXES:
        if key.startswith(prefix):
            neva = part_key_from_hf(key[len(prefix) :], "llm")
            return None if neva is None else "llm." + neva
    return None


def _pixel_budget(hf_dir: Path) -> dict[str, int]:
    """``min_pixels`` / ``max_pixels`` of the directory's image processor (either spelling), for the metadata."""
    path = hf_dir / "preprocessor_config.json"
    if not path.is_file():
        return {}
    pre = json.loads(path.read_text())
    size = pre.get("size") or {}
    low = pre.get("min_pixels", size.get("shortest_edge"))
    high = pre.get("max_pixels", size.get("longest_edge"))
    return {k: int(v) for k, v in (("min_pixels", low), ("max_pixels", high)) if v is not None}


def _check_expert_layout(shapes: dict[str, tuple[int, ...]], llm: LLMConfig, hf_dir: Path) -> None:
    """Refuse Qwen3-VL-MoE experts in the hub's transformers-4.x layout (``down_proj`` ``[E, I, H]``, ``gate_up_proj``
    ``[E, H, 2I]``), which transformers 5 transposes while loading: read as its own layout they would be other
    numbers. Where I == H the two cannot be told apart and transformers 5's own (``save_pretrained``'s) is taken."""
    if not llm.is_moe or llm.intermediate_size == llm.hidden_size:
        return
    hub = (llm.num_moe_experts, llm.intermediate_size, llm.hidden_size)
    for key, shape in shapes.items():
        if key.endswith("block_sparse_moe.experts.w2") and tuple(shape) == hub:
            raise ConfigError(
                f"{hf_dir}: {key.replace('block_sparse_moe.experts.w2', 'mlp.experts.down_proj')} has the "
                f"transformers 4.x layout {list(shape)} (experts, moe_intermediate_size, hidden_size), not yet read "
                "here: load the directory with transformers 5 and save_pretrained it, then import that"
            )


def import_qwen_vl(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    metadata: dict[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Convert a Qwen2-VL / Qwen2.5-VL / Qwen3-VL directory to a neva checkpoint (streaming, every tensor checked first).

    Raises:
        ConfigError: a Qwen-VL kind or field neva does not build. ValueError: tensors that map nowhere, missing
            model tensors, a tokenizer whose ``<|image_pad|>`` is not the config's image token.
    """
    cfg, tensors, tokenizer, meta = qwen_vl_parts(hf_dir, dtype=dtype, metadata=metadata)
    return save_checkpoint(
        out, cfg, tensors, tokenizer, max_shard_bytes=max_shard_bytes, metadata=meta, overwrite=overwrite
    )


def qwen_vl_parts(
    hf_dir: str | os.PathLike, *, dtype: torch.dtype | None = None, metadata: dict[str, Any] | None = None
) -> ImportedParts:
    """``import_qwen_vl`` up to the writing (also what ``neva.evaluate`` loads an HF directory in memory with).

    Raises:
        ConfigError, ValueError: as ``import_qwen_vl``.
    """
    hf_dir = Path(model_dir(hf_dir))
    hf = json.loads((hf_dir / "config.json").read_text())
    cfg = neva_config_from_qwen_vl(hf)
    kind = cfg.vision.kind
    # MoE experts in hf_moe's canonical form, Qwen3.5's fused linear-attention tensors as their q / k / v parts
    shapes = split_shapes(hf_tensor_shapes(hf_dir), cfg.llm.linear_attention)
    _check_expert_layout(shapes, cfg.llm, hf_dir)
    mapping, unknown = {}, []
    for key in shapes:
        neva = hf_key_to_neva(key, kind)
        if neva is not None:
            mapping[key] = neva
        elif "rotary" not in key and not key.startswith(_UNUSED_PREFIXES):
            unknown.append(key)
    if unknown:
        raise ValueError(f"{hf_dir}: {len(unknown)} tensor(s) with no neva counterpart, e.g. {unknown[:5]}")
    check_complete(cfg, {mapping[k]: shapes[k] for k in mapping}, str(hf_dir))
    tokenizer = None
    if has_tokenizer(hf_dir):
        from neva.data.sentencepiece_tokenizer import load_tokenizer

        tokenizer = load_tokenizer(hf_dir)
        found = tokenizer.get_vocab().get(QWEN_IMAGE_PAD)
        if found != cfg.image_token_id:
            raise ValueError(f"{hf_dir}: tokenizer maps {QWEN_IMAGE_PAD} to {found}, config says {cfg.image_token_id}")
    meta = {
        "source": {"kind": "qwen-vl", "path": str(hf_dir)},
        "conv_template": family_of(hf).template,
        **_pixel_budget(hf_dir),
        **(metadata or {}),
    }
    pairs = split_tensors(iter_hf_tensors(hf_dir), cfg.llm.linear_attention)
    tensors = ((mapping[k], cast_floating(t, dtype)) for k, t in pairs if k in mapping)
    return ImportedParts(cfg, tensors, tokenizer, meta)


def qwen_vl_config_dict(cfg: NevaConfig) -> dict[str, Any]:
    """The transformers 5 ``config.json`` of a neva Qwen-VL model (nested text and vision configs)."""
    rows = [row for row in QWEN_VL.values() if cfg.vision is not None and row.tower == cfg.vision.kind]
    if not rows:
        raise ConfigError("only a model with a Qwen2-VL / Qwen2.5-VL / Qwen3-VL tower exports as a Qwen-VL directory")
    family = _BY_TOWER.get((cfg.vision.kind, cfg.llm.family))
    if family is None:
        decoders = " / ".join(row.text_family for row in rows)
        raise ConfigError(f"a {cfg.vision.kind} tower exports with a {decoders} decoder, not {cfg.llm.family}")
    llm, v = cfg.llm, cfg.vision
    text = dict(
        vocab_size=llm.vocab_size, hidden_size=llm.hidden_size, intermediate_size=llm.intermediate_size,
        num_hidden_layers=llm.num_layers, num_attention_heads=llm.num_heads, num_key_value_heads=llm.num_kv_heads,
        rms_norm_eps=llm.rms_norm_eps, max_position_embeddings=llm.max_seq_len, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": llm.rope_theta, "mrope_section": llm.mrope_section},
        **{k: w for k, w in hf_family_fields(llm).items() if k != "model_type"},
    )  # fmt: skip
    if family.mrope_interleaved:
        text["rope_parameters"]["mrope_interleaved"] = True
    if llm.rotary_percent != 1.0:
        text["rope_parameters"]["partial_rotary_factor"] = llm.rotary_percent
    if family.text_family.startswith("qwen3"):  # HF Qwen3 configs default head_dim to 128, not hidden / heads
        text["head_dim"] = llm.head_dim
    vision = dict(
        depth=v.num_layers, num_heads=v.num_heads, patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
        spatial_merge_size=v.spatial_merge_size, in_channels=v.num_channels, hidden_act=v.hidden_act,
    )  # fmt: skip
    if family.tower == "qwen2_vl":
        if v.intermediate_size % v.hidden_size:
            raise ConfigError(
                f"Qwen2-VL's mlp_ratio is an integer: intermediate_size {v.intermediate_size} / hidden_size "
                f"{v.hidden_size}"
            )
        vision.update(
            embed_dim=v.hidden_size, mlp_ratio=v.intermediate_size // v.hidden_size, hidden_size=llm.hidden_size
        )
    elif family.tower == "qwen3_vl":
        vision.update(
            hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, out_hidden_size=llm.hidden_size,
            num_position_embeddings=v.num_position_embeddings,
            deepstack_visual_indexes=list(v.deepstack_visual_indexes),
        )  # fmt: skip
    else:
        vision.update(
            hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, out_hidden_size=llm.hidden_size,
            window_size=v.window_size, fullatt_block_indexes=list(v.fullatt_block_indexes),
        )  # fmt: skip
        if v.tokens_per_second is not None:
            vision["tokens_per_second"] = v.tokens_per_second
    return dict(
        model_type=family.model_type,
        architectures=[family.model_class],
        text_config=text,
        vision_config=vision,
        image_token_id=cfg.image_token_id,
        **({} if cfg.video_token_id is None else {"video_token_id": cfg.video_token_id}),
        tie_word_embeddings=llm.tie_word_embeddings,
    )


def peft_names(cfg: NevaConfig) -> tuple[Callable[[str], str], dict[str, tuple[str, ...]]] | None:
    """For a Qwen-VL model, a PEFT adapter's names of the parts saved whole (``peft_adapter.save_peft_adapter``'s
    ``saved_key`` / ``saved_modules``): tower and mergers under ``model.visual``, as transformers 5 names them;
    None for any other model."""
    family = _BY_TOWER.get((cfg.vision.kind, cfg.llm.family) if cfg.vision is not None else None)
    if family is None:
        return None
    kind = cfg.vision.kind
    # the merger, with Qwen3-VL's DeepStack mergers one by one (PEFT saves no ModuleList whole); a trained tower: the
    # visual model
    deepstack = tuple(f"visual.deepstack_merger_list.{i}" for i in range(cfg.projector.deepstack_mergers))
    mergers = ("visual.merger", *deepstack)
    return (lambda key: visual_key_to_hf(key, kind)), {"projector": mergers, "vision": ("visual",)}


def _hf_tensors(
    tensors: TensorSource, cfg: NevaConfig, dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    kind = cfg.vision.kind
    for key, tensor in tensor_pairs(tensors):
        part, rest = key.split(".", 1)
        tensor = cast_floating(tensor, dtype)
        if part in ("vision", "projector"):
            yield visual_key_to_hf(key, kind), tensor
        elif rest == LM_HEAD:
            if not cfg.llm.tie_word_embeddings:
                yield LM_HEAD_KEY, tensor
        else:  # MoE experts in hf_moe's canonical form, stacked below
            yield LLM_PREFIXES[0] + part_key_to_hf(rest, "llm"), tensor


def export_qwen_vl(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    conv_template: str | None = None,
) -> Path:
    """A neva Qwen-VL checkpoint → a directory transformers loads with the family's class and processor: weights,
    ``config.json`` (with the tokenizer's vision start / end ids and the weights' dtype), the tokenizer with the chat
    template the checkpoint was trained with (``hf_files``), ``generation_config.json`` stopping where ``neva.generate``
    stops (EOS and ``<|im_end|>``, with the pad id), and the image processor at the model's pixel budget (the
    checkpoint's ``min_pixels`` / ``max_pixels``, else the tower kind's defaults).

    ``dtype`` None exports in the run's half precision (as ``export_llava``); ``conv_template`` another chat template
    than the one the checkpoint records (else the family's)."""
    import transformers

    ckpt = Path(ckpt)
    cfg, meta = load_config(ckpt), load_metadata(ckpt)
    config = qwen_vl_config_dict(cfg)
    family_template = _BY_TOWER[(cfg.vision.kind, cfg.llm.family)].template
    settings = template_settings(meta, conv_template or meta.get("conv_template") or family_template)
    tokenizer = None
    if has_tokenizer(ckpt):
        from neva.data.sentencepiece_tokenizer import load_tokenizer

        tokenizer = load_tokenizer(ckpt)
        vocab = tokenizer.get_vocab()
        for key, token in (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
            if token in vocab:
                config[key] = vocab[token]
    dtype = dtype or export_dtype(meta)
    stored = str(dtype).removeprefix("torch.") if dtype is not None else meta.get("dtype")
    if stored:
        config["dtype"] = stored
    with atomic_directory(out, overwrite) as tmp:
        tensors = fuse_tensors(stacked_tensors(_hf_tensors(iter_tensors(ckpt), cfg, dtype)))
        write_safetensors(tmp, tensors, max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        spec = QwenImageSpec.for_tower(cfg.vision, meta.get("min_pixels"), meta.get("max_pixels"))
        # The PIL backend (as the llava-hf exports): transformers' default Qwen2-VL processors need torchvision.
        transformers.Qwen2VLImageProcessorPil(
            min_pixels=spec.min_pixels, max_pixels=spec.max_pixels, patch_size=spec.patch_size,
            temporal_patch_size=spec.temporal_patch_size, merge_size=spec.merge_size,
            image_mean=list(cfg.vision.image_mean), image_std=list(cfg.vision.image_std),
        ).save_pretrained(str(tmp))  # fmt: skip
        write_tokenizer_and_generation(tmp, settings, tokenizer)  # generate stops where neva.generate does
    return Path(out)


QWEN_VL_INTEROP = Interop(
    "Qwen-VL",
    is_qwen_vl,
    qwen_vl_parts,
    export_qwen_vl,
    round_trip_through(qwen_vl_config_dict, neva_config_from_qwen_vl),
    peft_names=peft_names,
)
