"""Mistral 3 directories (``Mistral3ForConditionalGeneration``) ↔ neva checkpoints: config, weights, tokenizer,
image processor and chat template.

A Mistral 3 model is neva's parts under other names: the ``pixtral`` tower (``vision_tower.``: ``patch_conv``,
``ln_pre``, ``transformer.layers.{i}.``), the ``pixtral_merger`` projector (``multi_modal_projector.``: ``norm``,
``patch_merger.merging_layer``, ``linear_1``, ``linear_2``) and a Mistral (or Llama) decoder
(``language_model.model.``; the decoder table every family shares). Both key layouts are read: transformers 5's
``save_pretrained`` (the names above, which it also writes) and its module names (``model.vision_tower.``,
``model.multi_modal_projector.``, ``model.language_model.``, ``lm_head.weight``).

Facts of transformers 5.25 this module relies on (checked by ``tests/checkpoint/test_mistral3_hf.py``): the LM head is
tied by the top-level ``tie_word_embeddings`` (default true); the features are the last block's
(``vision_feature_layer`` -1); the tower's norms take eps 1e-5 whatever the config says, the projector's norm the
decoder's ``rms_norm_eps``; the tower's rotary is ``axial`` at ``rope_theta``. ``[IMG_BREAK]`` and ``[IMG_END]`` are
not in the model config: their ids come from the tokenizer. Fields neva does not build are refused by name.
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
from neva.checkpoint.neva_format import TensorSource, iter_tensors, load_config, load_metadata, tensor_pairs
from neva.checkpoint.safetensors_io import DEFAULT_MAX_SHARD_BYTES, write_safetensors
from neva.data.templates.mistral3 import PIXTRAL_BREAK, PIXTRAL_END, PIXTRAL_IMAGE
from neva.families.hf_fields import CONFIG_BOOKKEEPING
from neva.hf_local import model_dir
from neva.models.config import NevaConfig, ProjectorConfig, VisionConfig
from neva.models.vision_pixtral import ROPE_THETA
from neva.typed import ConfigError

MODEL_TYPE = "mistral3"
TEMPLATE = "mistral3"
TEXT_FAMILIES = ("mistral", "llama")
TOWER_EPS = 1e-5  # HF PixtralRMSNorm's eps in the tower, fixed whatever the config says

# Pixtral: neva's name within a block → HF's within ``transformer.layers.{i}.``; outside the blocks, whole names.
_BLOCK = {
    "norm1.": "attention_norm.", "norm2.": "ffn_norm.", "attn.q_proj.": "attention.q_proj.",
    "attn.k_proj.": "attention.k_proj.", "attn.v_proj.": "attention.v_proj.", "attn.o_proj.": "attention.o_proj.",
    "mlp.gate_proj.": "feed_forward.gate_proj.", "mlp.up_proj.": "feed_forward.up_proj.",
    "mlp.down_proj.": "feed_forward.down_proj.",
}  # fmt: skip
_TOWER = {"patch_embed.weight": "patch_conv.weight", "pre_norm.weight": "ln_pre.weight"}
_PROJECTOR = {
    "norm.": "norm.", "merging_layer.": "patch_merger.merging_layer.", "linear_1.": "linear_1.",
    "linear_2.": "linear_2.",
}  # fmt: skip

# Top-level and vision fields: each read, needed at one value (the reason), or bookkeeping; any other is refused.
_TOP_NEEDS = {
    "projector_hidden_act": ("gelu", "the projector's activation is exact GELU"),
    "vision_feature_layer": (-1, "the merger reads the last block"),
}
_TOP_READ = (
    "text_config", "vision_config", "image_token_index", "image_token_id", "multimodal_projector_bias",
    "spatial_merge_size", "tie_word_embeddings",
)  # fmt: skip
_VISION_NEEDS = {"attention_dropout": (0.0, "neva's tower has no dropout")}
_VISION_READ = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels", "image_size",
    "patch_size", "hidden_act", "head_dim", "rope_parameters", "rope_theta",
)  # fmt: skip


def is_mistral3(hf: dict[str, Any]) -> bool:
    """Whether an HF ``config.json`` dict is a Mistral 3 model (imported here)."""
    return hf.get("model_type") == MODEL_TYPE


def _refused(fields: dict[str, Any], needs: dict[str, tuple[Any, str]], read: tuple[str, ...], where: str) -> None:
    bad = [f"{k}={fields[k]!r} ({why})" for k, (want, why) in needs.items() if k in fields and fields[k] != want]
    known = set(needs) | set(read) | set(CONFIG_BOOKKEEPING)
    bad += [f"{k}={v!r} (unknown to neva: it may change the computation)" for k, v in fields.items() if k not in known]
    if bad:
        raise ConfigError(f"{where}: refused field(s): " + "; ".join(bad))


def _side(value: Any, name: str) -> int:
    sides = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(set(sides)) != 1:
        raise ConfigError(f"mistral3 vision_config {name}={value}: only square {name}s are implemented")
    return int(sides[0])


def _check_vision_rope(v: dict[str, Any]) -> None:
    rope = dict(v.get("rope_parameters") or {})
    theta = rope.get("rope_theta", v.get("rope_theta", ROPE_THETA))
    if rope.get("rope_type", "axial") != "axial" or float(theta) != ROPE_THETA:
        raise ConfigError(
            f"mistral3 vision_config rope_parameters={rope or theta!r}: neva's Pixtral rotary is axial at theta "
            f"{ROPE_THETA:g}"
        )
    width, heads = v.get("hidden_size", 1024), v.get("num_attention_heads", 16)
    if v.get("head_dim", width // heads) != width // heads:
        raise ConfigError(f"mistral3 vision_config head_dim={v['head_dim']}: Pixtral's heads split hidden_size")


def neva_config_from_mistral3(hf: dict[str, Any], break_id: int | None = None, end_id: int | None = None) -> NevaConfig:
    """NevaConfig of a Mistral 3 ``config.json`` dict (transformers 5's nested text and vision configs), with the
    tokenizer's ``[IMG_BREAK]`` / ``[IMG_END]`` ids where known."""
    _refused(hf, _TOP_NEEDS, _TOP_READ, "mistral3 config")
    v = dict(hf.get("vision_config") or {})
    _refused(v, _VISION_NEEDS, _VISION_READ, "mistral3 vision_config")
    _check_vision_rope(v)
    text = dict(hf["text_config"])
    if text.get("model_type", "mistral") not in TEXT_FAMILIES:
        raise ConfigError(f"mistral3 text_config model_type {text.get('model_type')!r}: neva reads {TEXT_FAMILIES}")
    # transformers ties the LM head by the top-level field (default true), whatever the text config says.
    text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    llm = llm_config_from_hf(text, "mistral3 text_config")
    merge = int(hf.get("spatial_merge_size", 2))
    vision = VisionConfig(
        kind="pixtral",
        image_size=_side(v.get("image_size", 1024), "image_size"),
        patch_size=_side(v.get("patch_size", 16), "patch_size"),
        num_channels=v.get("num_channels", 3),
        hidden_size=v.get("hidden_size", 1024),
        intermediate_size=v.get("intermediate_size", 4096),
        num_layers=v.get("num_hidden_layers", 24),
        num_heads=v.get("num_attention_heads", 16),
        layer_norm_eps=TOWER_EPS,
        hidden_act=v.get("hidden_act", "gelu"),
        temporal_patch_size=1,
        spatial_merge_size=merge,
    )
    projector = ProjectorConfig(
        type="pixtral_merger",
        input_size=vision.hidden_size,
        output_size=llm.hidden_size,
        bias=bool(hf.get("multimodal_projector_bias", False)),
        spatial_merge_size=merge,
        norm_eps=llm.rms_norm_eps,
    )
    image_id = hf.get("image_token_index", hf.get("image_token_id", 10))
    return NevaConfig(
        llm=llm, vision=vision, projector=projector, image_token_id=image_id, image_break_token_id=break_id,
        image_end_token_id=end_id,
    )  # fmt: skip


KEYS = KeyTable(layers="transformer.layers.", block=_BLOCK, tower=_TOWER, projector=_PROJECTOR)
hf_key_to_neva, neva_key_to_hf = KEYS.to_neva, KEYS.to_hf


def _token_ids(tokenizer: Any, cfg_image_id: int, where: str) -> tuple[int | None, int | None]:
    vocab = tokenizer.get_vocab()
    if vocab.get(PIXTRAL_IMAGE) != cfg_image_id:
        raise ValueError(
            f"{where}: tokenizer maps {PIXTRAL_IMAGE} to {vocab.get(PIXTRAL_IMAGE)}, config says {cfg_image_id}"
        )
    return vocab.get(PIXTRAL_BREAK), vocab.get(PIXTRAL_END)


def _check_processor(hf_dir: Path, cfg: NevaConfig) -> None:
    """The image processor's longest edge is the tower's ``image_size`` here (neva's one setting for both)."""
    pre = hf_dir / "preprocessor_config.json"
    if not pre.is_file():
        return
    edge = (json.loads(pre.read_text()).get("size") or {}).get("longest_edge", cfg.vision.image_size)
    if edge != cfg.vision.image_size:
        raise ConfigError(
            f"{hf_dir}: preprocessor_config.json size.longest_edge={edge} differs from vision_config.image_size="
            f"{cfg.vision.image_size}; neva sizes images by the tower's image_size"
        )


def mistral3_parts(
    hf_dir: str | os.PathLike, *, dtype: torch.dtype | None = None, metadata: dict[str, Any] | None = None
) -> ImportedParts:
    """The import of a Mistral 3 directory up to the writing: every tensor's name and shape checked first.

    Raises:
        ConfigError: a field neva does not build. ValueError: tensors that map nowhere, missing model tensors, a
            tokenizer whose image token is not the config's.
    """
    hf_dir = Path(model_dir(hf_dir))
    hf = json.loads((hf_dir / "config.json").read_text())
    tokenizer, ids = None, (None, None)
    if has_tokenizer(hf_dir):
        from neva.data.sentencepiece_tokenizer import load_tokenizer

        tokenizer = load_tokenizer(hf_dir)
        ids = _token_ids(tokenizer, hf.get("image_token_index", hf.get("image_token_id", 10)), str(hf_dir))
    cfg = neva_config_from_mistral3(hf, *ids)
    _check_processor(hf_dir, cfg)
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
    check_complete(cfg, {n: tuple(shapes[k]) for k, n in mapping.items()}, str(hf_dir))
    meta = {"source": {"kind": MODEL_TYPE, "path": str(hf_dir)}, "conv_template": TEMPLATE, **(metadata or {})}
    tensors = ((mapping[k], cast_floating(t, dtype)) for k, t in iter_hf_tensors(hf_dir) if k in mapping)
    return ImportedParts(cfg, tensors, tokenizer, meta)


def mistral3_config_dict(cfg: NevaConfig) -> dict[str, Any]:
    """The transformers 5 ``config.json`` of a neva Mistral 3 model."""
    v, llm, p = cfg.vision, cfg.llm, cfg.projector
    if v is None or v.kind != "pixtral" or p is None or p.type != "pixtral_merger":
        raise ConfigError("only a pixtral tower with the pixtral_merger projector exports as a Mistral 3 model")
    if llm.family not in TEXT_FAMILIES or llm.mrope_section is not None:
        raise ConfigError(f"a Mistral 3 export needs a mistral or llama decoder, not {llm.family}")
    if v.layer_norm_eps != TOWER_EPS or p.norm_eps != llm.rms_norm_eps or cfg.anyres is not None or cfg.video:
        raise ConfigError(
            f"a Mistral 3 export has tower norms at eps {TOWER_EPS:g} and the projector's norm at the decoder's "
            "rms_norm_eps, without AnyRes or pooled video"
        )
    family = hf_family_fields(llm)
    text = dict(
        model_type=llm.family, vocab_size=llm.vocab_size, hidden_size=llm.hidden_size,
        intermediate_size=llm.intermediate_size, num_hidden_layers=llm.num_layers, num_attention_heads=llm.num_heads,
        num_key_value_heads=llm.num_kv_heads, head_dim=llm.head_dim, rms_norm_eps=llm.rms_norm_eps,
        max_position_embeddings=llm.max_seq_len, hidden_act="silu", tie_word_embeddings=llm.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": llm.rope_theta, **(llm.rope_scaling or {})},
        **{k: w for k, w in family.items() if k != "model_type"},
    )  # fmt: skip
    vision = dict(
        model_type="pixtral", hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
        num_hidden_layers=v.num_layers, num_attention_heads=v.num_heads, num_channels=v.num_channels,
        image_size=v.image_size, patch_size=v.patch_size, hidden_act=v.hidden_act,
        head_dim=v.hidden_size // v.num_heads, rope_parameters={"rope_type": "axial", "rope_theta": ROPE_THETA},
    )  # fmt: skip
    return dict(
        model_type=MODEL_TYPE,
        architectures=["Mistral3ForConditionalGeneration"],
        text_config=text,
        vision_config=vision,
        image_token_index=cfg.image_token_id,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        multimodal_projector_bias=p.bias,
        spatial_merge_size=v.spatial_merge_size,
        tie_word_embeddings=llm.tie_word_embeddings,
    )


def _hf_tensors(tensors: TensorSource, cfg: NevaConfig, dtype: torch.dtype | None) -> Iterator[tuple[str, Any]]:
    for key, tensor in tensor_pairs(tensors):
        if key == "llm." + LM_HEAD and cfg.llm.tie_word_embeddings:
            continue
        yield neva_key_to_hf(key), cast_floating(tensor, dtype)


# The chat template an export ships: Mistral 3's format (neva's ``mistral3`` template: an image part is ``[IMG]``,
# which PixtralProcessor expands to the image's rows), written out here, not copied.
CHAT_TEMPLATE = (
    "{{- bos_token -}}{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' -}}"
    "{%- elif message['role'] == 'user' -%}{{- '[INST]' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'image' -%}{{- '[IMG]' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '[/INST]' -}}{%- else -%}{{- message['content'] + eos_token -}}{%- endif -%}{%- endfor -%}"
)


def export_mistral3(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """A neva Mistral 3 checkpoint → a directory transformers loads with ``Mistral3ForConditionalGeneration``:
    weights, ``config.json``, Pixtral's image processor (PIL backend, the tower's longest edge and statistics),
    ``processor_config.json`` (``PixtralProcessor``'s patch size, merge and image tokens) and the tokenizer with the
    chat template. ``dtype`` None exports in the run's half precision (as ``export_llava``)."""
    import transformers

    ckpt = Path(ckpt)
    cfg, meta = load_config(ckpt), load_metadata(ckpt)
    config = mistral3_config_dict(cfg)
    v = cfg.vision
    with atomic_directory(out, overwrite) as tmp:
        write_safetensors(tmp, _hf_tensors(iter_tensors(ckpt), cfg, dtype or export_dtype(meta)), max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        transformers.PixtralImageProcessorPil(
            size={"longest_edge": v.image_size}, patch_size={"height": v.patch_size, "width": v.patch_size},
            image_mean=list(v.image_mean), image_std=list(v.image_std),
        ).save_pretrained(str(tmp))  # fmt: skip
        processor = dict(
            processor_class="PixtralProcessor", patch_size=v.patch_size, spatial_merge_size=v.spatial_merge_size,
            image_token=PIXTRAL_IMAGE, image_break_token=PIXTRAL_BREAK, image_end_token=PIXTRAL_END,
        )  # fmt: skip
        (tmp / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
        if has_tokenizer(ckpt):
            from neva.data.sentencepiece_tokenizer import load_tokenizer

            tokenizer = load_tokenizer(ckpt)
            tokenizer.chat_template = CHAT_TEMPLATE
            tokenizer.save_pretrained(str(tmp))
    return Path(out)


# Not built yet: the PEFT adapter's names of the projector and tower saved whole are Mistral 3's own modules.
MISTRAL3_INTEROP = Interop(
    "Mistral 3",
    is_mistral3,
    mistral3_parts,
    own_template(export_mistral3),
    round_trip_through(mistral3_config_dict, neva_config_from_mistral3),
    peft_adapter=False,
)
