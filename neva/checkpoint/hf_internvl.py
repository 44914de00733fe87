"""InternVL 3 / 3.5 directories (``InternVLForConditionalGeneration``) ↔ neva checkpoints: config, weights, tokenizer,
tiling processor and chat template.

An InternVL model is neva's parts under other names: the ``internvl`` tower (InternViT: ``vision_tower.``), the
``mlp_pixel_shuffle`` projector (``multi_modal_projector.``: ``layer_norm``, ``linear_1``, ``linear_2``) and a Qwen2
or Qwen3 decoder (``language_model.model.``; the decoder table every family shares). Both key layouts are read:
transformers 5's ``save_pretrained`` (the legacy names above, which it also writes) and its module names
(``model.vision_tower.``, ``model.multi_modal_projector.``, ``model.language_model.``). The class token and position
table are ``[1, 1, H]`` / ``[1, N + 1, H]`` there, ``[H]`` / ``[N + 1, H]`` here.

Facts of transformers 5.25 this module relies on (checked by ``tests/checkpoint/test_internvl_hf.py``): the LM head is
tied to the embeddings by the top-level ``tie_word_embeddings`` (default true), whatever the text config says; the
features are the last block's patches (``vision_feature_layer`` -1, ``default`` strategy) through the pixel shuffle
at ``downsample_ratio`` 0.5 and an exact-GELU projector; the post-LayerNorm is an Identity under
``use_mean_pooling``. Fields neva does not build are refused by name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint.atomic import atomic_directory
from neva.checkpoint.hf_config import llm_config_from_hf
from neva.checkpoint.hf_families import hf_family_fields
from neva.checkpoint.hf_files import export_dtype
from neva.checkpoint.hf_import import ImportedParts
from neva.checkpoint.hf_key_table import KeyTable
from neva.checkpoint.hf_keys import LM_HEAD
from neva.checkpoint.hf_read import cast_floating, check_complete, has_tokenizer, hf_tensor_shapes, iter_hf_tensors
from neva.checkpoint.interop import Interop, own_template, round_trip_through
from neva.checkpoint.neva_format import (
    TensorSource,
    iter_tensors,
    load_config,
    load_metadata,
    tensor_pairs,
)
from neva.checkpoint.safetensors_io import DEFAULT_MAX_SHARD_BYTES, write_safetensors
from neva.data.internvl_tiles import MAX_TILES, MIN_TILES
from neva.data.templates.internvl import INTERNVL_IMAGE_CONTEXT
from neva.families.hf_fields import CONFIG_BOOKKEEPING
from neva.hf_local import model_dir
from neva.models.config import NevaConfig, ProjectorConfig, VisionConfig
from neva.typed import ConfigError

MODEL_TYPE = "internvl"
TEMPLATE = "internvl"
TEXT_FAMILIES = ("qwen2", "qwen3")
START_IMAGE, END_IMAGE, VIDEO = "<img>", "</img>", "<video>"

# InternViT: neva's name within a block → HF's within ``encoder.layer.{i}.``; outside the blocks, whole names.
_BLOCK = {
    "norm1.": "layernorm_before.", "norm2.": "layernorm_after.", "attn.q_proj.": "attention.q_proj.",
    "attn.k_proj.": "attention.k_proj.", "attn.v_proj.": "attention.v_proj.",
    "attn.o_proj.": "attention.projection_layer.", "attn.q_norm.": "attention.q_norm.",
    "attn.k_norm.": "attention.k_norm.", "lambda_1": "lambda_1", "lambda_2": "lambda_2", "mlp.fc1.": "mlp.fc1.",
    "mlp.fc2.": "mlp.fc2.",
}  # fmt: skip
_TOWER = {
    "cls_token": "embeddings.cls_token", "pos_embed.weight": "embeddings.position_embeddings",
    "patch_embed.weight": "embeddings.patch_embeddings.projection.weight",
    "patch_embed.bias": "embeddings.patch_embeddings.projection.bias",
}  # fmt: skip
_PROJECTOR = {"1.": "layer_norm.", "2.": "linear_1.", "4.": "linear_2."}

# Top-level and vision fields: each read, needed at one value (the reason), or known not to change the computation
# (bookkeeping, initialisation); any other field is refused by name (it may change the computation).
_VISION_NEEDS = {
    "use_mean_pooling": (True, "the post-LayerNorm of use_mean_pooling=false is not implemented"),
    "use_absolute_position_embeddings": (True, "a tower without learned positions is not implemented"),
    "use_mask_token": (False, "masked-image-modeling's mask token is not used by InternVL"),
    "hidden_dropout_prob": (0.0, "neva's tower has no dropout"),
    "attention_dropout": (0.0, "neva's tower has no dropout"),
    "projection_dropout": (0.0, "neva's tower has no dropout"),
}
_VISION_READ = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size", "patch_size",
    "num_channels", "hidden_act", "layer_norm_eps", "norm_type", "use_qk_norm", "attention_bias",
    "layer_scale_init_value",  # an initial value (the checkpoint holds the scales)
)  # fmt: skip
_TOP_NEEDS = {
    "downsample_ratio": (0.5, "neva's pixel shuffle merges 2×2 blocks only"),
    "projector_hidden_act": ("gelu", "the projector's activation is exact GELU"),
    "vision_feature_layer": (-1, "InternVL's features are the last block's"),
    "vision_feature_select_strategy": ("default", "the pixel shuffle needs the class token dropped"),
}
_TOP_READ = ("text_config", "vision_config", "image_token_id", "image_seq_length", "tie_word_embeddings")


def is_internvl(hf: dict[str, Any]) -> bool:
    """Whether an HF ``config.json`` dict is an InternVL model (imported here)."""
    return hf.get("model_type") == MODEL_TYPE


def _square(value: Any, name: str) -> int:
    sides = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(set(sides)) != 1:
        raise ConfigError(f"internvl vision_config {name}={value}: only square {name}s are implemented")
    return int(sides[0])


def _refused(fields: dict[str, Any], needs: dict[str, tuple[Any, str]], read: tuple[str, ...], where: str) -> None:
    bad = [f"{k}={fields[k]!r} ({why})" for k, (want, why) in needs.items() if k in fields and fields[k] != want]
    known = set(needs) | set(read) | set(CONFIG_BOOKKEEPING)
    bad += [f"{k}={v!r} (unknown to neva: it may change the computation)" for k, v in fields.items() if k not in known]
    if bad:
        raise ConfigError(f"{where}: refused field(s): " + "; ".join(bad))


def neva_config_from_internvl(hf: dict[str, Any]) -> NevaConfig:
    """NevaConfig of an InternVL ``config.json`` dict (transformers 5's nested text and vision configs)."""
    _refused(hf, _TOP_NEEDS, _TOP_READ, "internvl config")
    v = dict(hf.get("vision_config") or {})
    _refused(v, _VISION_NEEDS, _VISION_READ, "internvl vision_config")
    text = dict(hf["text_config"])
    if text.get("model_type", "qwen2") not in TEXT_FAMILIES:
        raise ConfigError(f"internvl text_config model_type {text.get('model_type')!r}: neva reads {TEXT_FAMILIES}")
    # transformers ties the LM head by the top-level field (default true), whatever the text config says.
    text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    llm = llm_config_from_hf(text, "internvl text_config")
    vision = VisionConfig(
        kind="internvl",
        image_size=_square(v.get("image_size", 448), "image_size"),
        patch_size=_square(v.get("patch_size", 14), "patch_size"),
        num_channels=v.get("num_channels", 3),
        hidden_size=v.get("hidden_size", 1024),
        intermediate_size=v.get("intermediate_size", 4096),
        num_layers=v.get("num_hidden_layers", 24),
        num_heads=v.get("num_attention_heads", 16),
        layer_norm_eps=v.get("layer_norm_eps", 1e-6),
        hidden_act=v.get("hidden_act", "gelu"),
        norm_type={"layer_norm": "layer", "rms_norm": "rms"}[v.get("norm_type", "layer_norm")],
        qk_norm=bool(v.get("use_qk_norm", False)),
        qkv_bias=bool(v.get("attention_bias", False)),
    )
    projector = ProjectorConfig(
        type="mlp_pixel_shuffle", input_size=vision.hidden_size, output_size=llm.hidden_size, bias=True
    )
    cfg = NevaConfig(llm=llm, vision=vision, projector=projector, image_token_id=hf.get("image_token_id", 151667))
    seq = hf.get("image_seq_length", cfg.num_image_tokens)
    if seq != cfg.num_image_tokens:
        raise ConfigError(
            f"internvl image_seq_length {seq} != the {cfg.num_image_tokens} tokens a tile of the vision config makes"
        )
    return cfg


KEYS = KeyTable(layers="encoder.layer.", block=_BLOCK, tower=_TOWER, projector=_PROJECTOR)
hf_key_to_neva, neva_key_to_hf = KEYS.to_neva, KEYS.to_hf


def _neva_shape(key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """HF's ``[1, 1, H]`` class token and ``[1, N + 1, H]`` positions without the leading ones."""
    return shape[-1:] if key == "vision.cls_token" else shape[1:] if key == "vision.pos_embed.weight" else shape


def internvl_parts(
    hf_dir: str | os.PathLike, *, dtype: torch.dtype | None = None, metadata: dict[str, Any] | None = None
) -> ImportedParts:
    """The import of a InternVL directory up to the writing (its interop's ``import_dir`` writes it; ``neva.evaluate``
    loads an HF directory in memory with it): every tensor's name and shape checked first.

    Raises:
        ConfigError: a field neva does not build. ValueError: tensors that map nowhere, missing model tensors, a
            tokenizer whose image token is not the config's.
    """
    hf_dir = Path(model_dir(hf_dir))
    cfg = neva_config_from_internvl(json.loads((hf_dir / "config.json").read_text()))
    shapes = hf_tensor_shapes(hf_dir)
    mapping, unknown = {}, []
    for key in shapes:
        neva = hf_key_to_neva(key)
        if neva is None:
            unknown.append(key)
        elif not (neva == "llm." + LM_HEAD and cfg.llm.tie_word_embeddings):  # a tied head is the embedding
            mapping[key] = neva
    if unknown:
        raise ValueError(f"{hf_dir}: {len(unknown)} tensor(s) with no neva counterpart, e.g. {unknown[:5]}")
    check_complete(cfg, {n: _neva_shape(n, shapes[k]) for k, n in mapping.items()}, str(hf_dir))
    tokenizer = None
    if has_tokenizer(hf_dir):
        from neva.data.sentencepiece_tokenizer import load_tokenizer

        tokenizer = load_tokenizer(hf_dir)
        found = tokenizer.get_vocab().get(INTERNVL_IMAGE_CONTEXT)
        if found != cfg.image_token_id:
            raise ValueError(
                f"{hf_dir}: tokenizer maps {INTERNVL_IMAGE_CONTEXT} to {found}, config says {cfg.image_token_id}"
            )
    meta = {"source": {"kind": "internvl", "path": str(hf_dir)}, "conv_template": TEMPLATE, **(metadata or {})}
    tensors = (
        (mapping[k], cast_floating(t, dtype).reshape(_neva_shape(mapping[k], tuple(t.shape))))
        for k, t in iter_hf_tensors(hf_dir)
        if k in mapping
    )
    return ImportedParts(cfg, tensors, tokenizer, meta)


def internvl_config_dict(cfg: NevaConfig) -> dict[str, Any]:
    """The transformers 5 ``config.json`` of a neva InternVL model."""
    v, llm = cfg.vision, cfg.llm
    if v is None or v.kind != "internvl" or cfg.projector is None or cfg.projector.type != "mlp_pixel_shuffle":
        raise ConfigError("only an internvl tower with the mlp_pixel_shuffle projector exports as an InternVL model")
    if llm.family not in TEXT_FAMILIES or llm.mrope_section is not None:
        raise ConfigError(f"an InternVL export needs a qwen2 or qwen3 decoder, not {llm.family}")
    if v.select_indices != [v.num_layers] or not cfg.projector.bias or cfg.anyres is not None or cfg.video:
        raise ConfigError(
            "an InternVL export reads the last block (vision_select_layer -1) through a biased projector, without "
            "AnyRes or pooled video"
        )
    text = dict(
        model_type=llm.family, vocab_size=llm.vocab_size, hidden_size=llm.hidden_size,
        intermediate_size=llm.intermediate_size, num_hidden_layers=llm.num_layers, num_attention_heads=llm.num_heads,
        num_key_value_heads=llm.num_kv_heads, head_dim=llm.head_dim, rms_norm_eps=llm.rms_norm_eps,
        max_position_embeddings=llm.max_seq_len, hidden_act="silu", tie_word_embeddings=llm.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": llm.rope_theta, **(llm.rope_scaling or {})},
        **{k: w for k, w in hf_family_fields(llm).items() if k != "model_type"},
    )  # fmt: skip
    vision = dict(
        model_type="internvl_vision", hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
        num_hidden_layers=v.num_layers, num_attention_heads=v.num_heads, image_size=[v.image_size] * 2,
        patch_size=[v.patch_size] * 2, num_channels=v.num_channels, hidden_act=v.hidden_act,
        layer_norm_eps=v.layer_norm_eps, norm_type={"layer": "layer_norm", "rms": "rms_norm"}[v.norm_type],
        use_qk_norm=v.qk_norm, attention_bias=v.qkv_bias, use_mean_pooling=True,
    )  # fmt: skip
    return dict(
        model_type=MODEL_TYPE,
        architectures=["InternVLForConditionalGeneration"],
        text_config=text,
        vision_config=vision,
        image_token_id=cfg.image_token_id,
        image_seq_length=cfg.num_image_tokens,
        downsample_ratio=0.5,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=llm.tie_word_embeddings,
    )


def _hf_tensors(tensors: TensorSource, cfg: NevaConfig, dtype: torch.dtype | None) -> Iterator[tuple[str, Any]]:
    width = cfg.vision.hidden_size
    for key, tensor in tensor_pairs(tensors):
        if key == "llm." + LM_HEAD and cfg.llm.tie_word_embeddings:
            continue
        tensor = cast_floating(tensor, dtype)
        if key in ("vision.cls_token", "vision.pos_embed.weight"):
            tensor = tensor.reshape(1, -1, width)
        yield neva_key_to_hf(key), tensor


# The chat template an export ships: transformers' InternVL format (ChatML; an image part is ``<IMG_CONTEXT>\n``,
# which InternVLProcessor expands to ``<img>`` + the tile tokens + ``</img>``), written out here, not copied.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'image' -%}{{- '<IMG_CONTEXT>\\n' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<video>\\n' -}}{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}{%- endif -%}{%- endfor -%}{%- endif -%}{{- '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def export_internvl(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """A neva InternVL checkpoint → a directory transformers loads with ``InternVLForConditionalGeneration``: weights,
    ``config.json``, the tiling image processor (``GotOcr2ImageProcessor``'s PIL backend at the tower's tile size,
    1–12 tiles, the thumbnail, the tower's statistics), ``processor_config.json`` (tokens per tile) and the tokenizer
    with InternVL's chat template and the special tokens ``InternVLProcessor`` reads.

    ``dtype`` None exports in the run's half precision (as ``export_llava``)."""
    import transformers

    ckpt = Path(ckpt)
    cfg, meta = load_config(ckpt), load_metadata(ckpt)
    config = internvl_config_dict(cfg)
    v = cfg.vision
    with atomic_directory(out, overwrite) as tmp:
        write_safetensors(tmp, _hf_tensors(iter_tensors(ckpt), cfg, dtype or export_dtype(meta)), max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        transformers.GotOcr2ImageProcessorPil(
            size={"height": v.image_size, "width": v.image_size}, crop_to_patches=True, min_patches=MIN_TILES,
            max_patches=MAX_TILES, image_mean=list(v.image_mean), image_std=list(v.image_std),
        ).save_pretrained(str(tmp))  # fmt: skip
        (tmp / "processor_config.json").write_text(
            json.dumps({"processor_class": "InternVLProcessor", "image_seq_length": cfg.num_image_tokens}, indent=2)
        )
        if has_tokenizer(ckpt):
            from neva.data.sentencepiece_tokenizer import load_tokenizer

            # InternVLProcessor reads these names from its tokenizer (transformers' named special tokens).
            named = dict(context_image_token=INTERNVL_IMAGE_CONTEXT, start_image_token=START_IMAGE,
                         end_image_token=END_IMAGE, video_token=VIDEO)  # fmt: skip
            tokenizer = load_tokenizer(ckpt, model_specific_special_tokens=named)
            tokenizer.chat_template = CHAT_TEMPLATE
            tokenizer.save_pretrained(str(tmp))
    return Path(out)


# Not built yet: the PEFT adapter's names of the projector and tower saved whole are InternVL's own modules.
INTERNVL_INTEROP = Interop(
    "InternVL",
    is_internvl,
    internvl_parts,
    own_template(export_internvl),
    round_trip_through(internvl_config_dict, neva_config_from_internvl),
    peft_adapter=False,
)
