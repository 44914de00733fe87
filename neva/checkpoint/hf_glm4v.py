"""GLM-4.1V directories (``Glm4vForConditionalGeneration``) ↔ neva checkpoints: config, weights, tokenizer, pixel
budget and chat template.

A GLM-4.1V model is neva's parts under other names: the ``glm4v`` tower (``model.visual.`` up to its
``post_layernorm``), the ``glm4v_merger`` projector (``model.visual.downsample`` and ``model.visual.merger``) and a
``glm4v_text`` decoder (``model.language_model.``): the shared decoder table, except that GLM's four norms per layer
have their own names, its MLP's gate and up projections are one fused ``gate_up_proj`` (gate rows first), and its
rotary pairs channels (2i, 2i + 1) of each head's first ``rotary_dim`` where neva's pairs (i, i + rotary_dim / 2):
the q and k rows (weights and biases) are permuted on import and back on export, which leaves every attention score
as it was.

Facts of transformers 5.25 this module relies on (checked by ``tests/checkpoint/test_glm4v_hf.py``): the text head
size is ``hidden_size / num_attention_heads`` (a ``head_dim`` field is not read), ``rope_parameters`` carries
``partial_rotary_factor`` and ``mrope_section`` ([8, 12, 12] when absent), the vision MLP is ``out_hidden_size``
wide, the merger's LayerNorm has eps 1e-5, and the LM head is untied unless the top-level ``tie_word_embeddings``
says so. Fields neva does not build are refused by name. Video (frames with timestamp text) is not imported: the
model takes images.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint.atomic import atomic_directory
from neva.checkpoint.hf_files import (
    export_dtype,
    template_settings,
    write_tokenizer_and_generation,
)
from neva.checkpoint.hf_import import ImportedParts
from neva.checkpoint.hf_keys import LM_HEAD, part_key_from_hf, part_key_to_hf
from neva.checkpoint.hf_read import cast_floating, check_complete, has_tokenizer, hf_tensor_shapes, iter_hf_tensors
from neva.checkpoint.interop import Interop, round_trip_through
from neva.checkpoint.neva_format import TensorSource, iter_tensors, load_config, load_metadata, tensor_pairs
from neva.checkpoint.safetensors_io import DEFAULT_MAX_SHARD_BYTES, write_safetensors
from neva.data.qwen_images import QwenImageSpec
from neva.data.templates.glm4v import GLM4V_IMAGE
from neva.families.hf_fields import CONFIG_BOOKKEEPING
from neva.hf_local import model_dir
from neva.models.config import LLMConfig, NevaConfig, ProjectorConfig, VisionConfig
from neva.typed import ConfigError

MODEL_TYPE = "glm4v"
TEMPLATE = "glm4v"
NOT_YET = {"glm4v_moe": "GLM-4.5V's MoE decoder (shared experts, a sigmoid router with bias correction)"}
DEFAULT_MROPE_SECTION = [8, 12, 12]  # Glm4vTextRotaryEmbedding's when rope_parameters names none
VISUAL = "model.visual."
LLM_PREFIX = "model.language_model."
LM_HEAD_KEY = "lm_head.weight"
SPECIAL_IDS = {  # config field → the token Glm4vProcessor / the chat template writes
    "image_start_token_id": "<|begin_of_image|>",
    "image_end_token_id": "<|end_of_image|>",
    "video_start_token_id": "<|begin_of_video|>",
    "video_end_token_id": "<|end_of_video|>",
    "video_token_id": "<|video|>",
}

# neva (under "vision." / "projector.") : HF (under "model.visual.")
_TOWER = {
    "vision.patch_embed.": "patch_embed.proj.", "vision.post_conv_norm.": "post_conv_layernorm.",
    "vision.pos_embed.": "embeddings.position_embedding.", "vision.post_norm.": "post_layernorm.",
    "projector.downsample.": "downsample.", "projector.proj.": "merger.proj.",
    "projector.norm.": "merger.post_projection_norm.", "projector.gate_proj.": "merger.gate_proj.",
    "projector.up_proj.": "merger.up_proj.", "projector.down_proj.": "merger.down_proj.",
}  # fmt: skip
_BLOCK = {
    "norm1.": "norm1.",
    "norm2.": "norm2.",
    "attn.qkv.": "attn.qkv.",
    "attn.o_proj.": "attn.proj.",
    "mlp.": "mlp.",
}
# GLM's norms per decoder layer (HF name → neva's): before attention, after it (before the residual add), before the
# MLP, after it.
_NORMS = {
    "input_layernorm": "attention_norm",
    "post_self_attn_layernorm": "post_attention_norm",
    "post_attention_layernorm": "ffn_norm",
    "post_mlp_layernorm": "post_ffn_norm",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")
_FUSED = "mlp.gate_up_proj.weight"
_ROTATED = ("attention.wq.", "attention.wk.")

# Config fields: each read, needed at one value (the reason), or bookkeeping; any other is refused by name.
_TEXT_READ = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "tie_word_embeddings",
    "model_type", "initializer_range", "use_cache", "pad_token_id", "eos_token_id", "bos_token_id",
)  # fmt: skip
_TEXT_NEEDS = {"hidden_act": ("silu", "the decoder's MLP is SwiGLU"), "attention_dropout": (0.0, "no dropout")}
_VISION_READ = (
    "depth", "hidden_size", "num_heads", "in_channels", "image_size", "patch_size", "rms_norm_eps",
    "spatial_merge_size", "temporal_patch_size", "out_hidden_size", "intermediate_size", "attention_bias",
    "model_type", "initializer_range", "rope_parameters",
)  # fmt: skip
_VISION_NEEDS = {"hidden_act": ("silu", "the tower's and merger's SwiGLU"), "attention_dropout": (0.0, "no dropout")}
_TOP_READ = ("text_config", "vision_config", "image_token_id", "tie_word_embeddings", "model_type", *SPECIAL_IDS)


def is_glm4v(hf: dict[str, Any]) -> bool:
    """Whether an HF ``config.json`` dict is a GLM-4.1V model (or GLM-4.5V, refused by name on import)."""
    return hf.get("model_type") in (MODEL_TYPE, *NOT_YET)


def _refuse_unknown(fields: dict[str, Any], read: tuple[str, ...], needs: dict[str, tuple[Any, str]], where: str):
    for name, value in fields.items():
        if name in needs and value != needs[name][0]:
            raise ConfigError(f"{where} {name}={value!r}: neva builds {needs[name][0]!r} only ({needs[name][1]})")
        if name not in read and name not in needs and name not in CONFIG_BOOKKEEPING:
            raise ConfigError(f"{where} field {name!r} is not read by neva's GLM-4.1V import (it may change the model)")


def neva_config_from_glm4v(hf: dict[str, Any]) -> NevaConfig:
    """NevaConfig of a GLM-4.1V ``config.json`` dict (transformers 5's nested layout).

    Raises:
        ConfigError: GLM-4.5V, a field neva does not build, a rope it does not implement, mismatched widths.
    """
    if hf.get("model_type") in NOT_YET:
        raise ConfigError(f"model_type {hf['model_type']!r} is not supported yet ({NOT_YET[hf['model_type']]})")
    _refuse_unknown(hf, _TOP_READ, {}, "glm4v")
    text, v = dict(hf.get("text_config") or {}), dict(hf.get("vision_config") or {})
    _refuse_unknown(text, _TEXT_READ, _TEXT_NEEDS, "glm4v text_config")
    _refuse_unknown(v, _VISION_READ, _VISION_NEEDS, "glm4v vision_config")
    rope = dict(text.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"glm4v text rope_type {rope['rope_type']!r}: only default M-RoPE is implemented")
    vrope = v.get("rope_parameters") or {}
    if vrope.get("rope_theta", 10000.0) != 10000.0 or vrope.get("rope_type", "axial") != "axial":
        raise ConfigError(f"glm4v vision rope_parameters {vrope}: neva's 2-D rotary is axial with base 10000")
    heads = text["num_attention_heads"]
    llm = dict(
        family="glm4v_text", vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"], num_layers=text["num_hidden_layers"], num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads") or heads, head_dim=text["hidden_size"] // heads,
        rms_norm_eps=text.get("rms_norm_eps", 1e-5), max_seq_len=text.get("max_position_embeddings", 32768),
        rope_theta=float(rope.get("rope_theta", 10000.0)), qkv_bias=True,
        mrope_section=list(rope.get("mrope_section", DEFAULT_MROPE_SECTION)),
        rotary_percent=float(rope.get("partial_rotary_factor", 1.0)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )  # fmt: skip
    patch, image_size = v.get("patch_size", 14), v.get("image_size", 336)
    try:
        llm_cfg = LLMConfig(**llm)
        vision = VisionConfig(
            kind="glm4v", image_size=image_size, patch_size=patch, num_channels=v.get("in_channels", 3),
            hidden_size=v["hidden_size"], intermediate_size=v["out_hidden_size"], num_layers=v["depth"],
            num_heads=v["num_heads"], layer_norm_eps=v.get("rms_norm_eps", 1e-5), hidden_act="silu",
            temporal_patch_size=v.get("temporal_patch_size", 2), spatial_merge_size=v.get("spatial_merge_size", 2),
            num_position_embeddings=(image_size // patch) ** 2, norm_type="rms",
            qkv_bias=bool(v.get("attention_bias", False)),
        )  # fmt: skip
        projector = ProjectorConfig(
            type="glm4v_merger", input_size=vision.hidden_size, output_size=v["out_hidden_size"], bias=False,
            spatial_merge_size=vision.spatial_merge_size, intermediate_size=v["intermediate_size"],
        )  # fmt: skip
        return NevaConfig(llm=llm_cfg, vision=vision, projector=projector, image_token_id=hf["image_token_id"])
    except ValueError as err:  # a value the parts cannot be built with: the file's, refused
        raise ConfigError(f"glm4v config: {err}") from None


def rotary_order(llm: LLMConfig) -> torch.Tensor:
    """The q / k output rows of one head in neva's order: row j holds HF's row ``order[j]`` (HF's pairs (2i, 2i + 1)
    of the rotary channels become neva's (i, i + rotary_dim / 2); the channels past ``rotary_dim`` stay)."""
    rot = llm.rotary_dim
    return torch.cat([torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, llm.head_dim)])


def _permute_heads(tensor: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    rows = tensor.shape[0]
    heads = rows // order.numel()
    return tensor.reshape(heads, order.numel(), -1)[:, order].reshape(rows, *tensor.shape[1:])


def hf_key_to_neva(key: str) -> list[str]:
    """neva keys of a GLM-4.1V tensor (two for the fused ``gate_up_proj``; none: a key neva does not keep)."""
    if key == LM_HEAD_KEY:
        return ["llm." + LM_HEAD]
    if key.startswith(VISUAL):
        rest = key[len(VISUAL) :]
        for neva, hf in _TOWER.items():
            if rest.startswith(hf):
                return [neva + rest[len(hf) :]]
        if rest.startswith("blocks."):
            index, _, tail = rest[len("blocks.") :].partition(".")
            for neva, hf in _BLOCK.items():
                if tail.startswith(hf):
                    return [f"vision.layers.{index}.{neva}{tail[len(hf) :]}"]
        return []
    if not key.startswith(LLM_PREFIX):
        return []
    rest = key[len(LLM_PREFIX) :]
    match = _LAYER.match(rest)
    if match:
        index, tail = match.groups()
        if tail == _FUSED:
            return [f"llm.layers.{index}.feed_forward.w1.weight", f"llm.layers.{index}.feed_forward.w3.weight"]
        name, _, kind = tail.partition(".")
        if name in _NORMS:
            return [f"llm.layers.{index}.{_NORMS[name]}.{kind}"]
    neva = part_key_from_hf(rest, "llm")
    return [] if neva is None else ["llm." + neva]


def neva_key_to_hf(key: str) -> str:
    """HF key of a neva key of a GLM-4.1V model (``feed_forward.w1`` / ``w3``: the fused ``gate_up_proj``)."""
    part, rest = key.split(".", 1)
    if part in ("vision", "projector"):
        for neva, hf in _TOWER.items():
            if key.startswith(neva):
                return VISUAL + hf + key[len(neva) :]
        _, index, tail = rest.split(".", 2)
        return f"{VISUAL}blocks.{index}." + next(h + tail[len(n) :] for n, h in _BLOCK.items() if tail.startswith(n))
    if rest == LM_HEAD:
        return LM_HEAD_KEY
    match = _LAYER.match(rest)
    if match:
        index, tail = match.groups()
        if tail in ("feed_forward.w1.weight", "feed_forward.w3.weight"):
            return f"{LLM_PREFIX}layers.{index}.{_FUSED}"
        name, _, kind = tail.partition(".")
        for hf, neva in _NORMS.items():
            if name == neva:
                return f"{LLM_PREFIX}layers.{index}.{hf}.{kind}"
    return LLM_PREFIX + part_key_to_hf(rest, "llm")


def _pixel_budget(hf_dir: Path) -> dict[str, int]:
    """The directory's image processor ``size`` (shortest_edge / longest_edge: min / max pixels), for the metadata."""
    path = hf_dir / "preprocessor_config.json"
    if not path.is_file():
        return {}
    size = json.loads(path.read_text()).get("size") or {}
    pairs = (("min_pixels", size.get("shortest_edge")), ("max_pixels", size.get("longest_edge")))
    return {k: int(v) for k, v in pairs if v is not None}


def glm4v_parts(
    hf_dir: str | os.PathLike, *, dtype: torch.dtype | None = None, metadata: dict[str, Any] | None = None
) -> ImportedParts:
    """The import of a GLM-4.1V directory up to the writing (its interop's ``import_dir`` writes it; ``neva.evaluate``
    loads an HF directory in memory with it): every tensor's name and shape checked first.

    Raises:
        ConfigError: a field neva does not build. ValueError: tensors that map nowhere, missing model tensors, a
            tokenizer whose ``<|image|>`` is not the config's image token.
    """
    hf_dir = Path(model_dir(hf_dir))
    cfg = neva_config_from_glm4v(json.loads((hf_dir / "config.json").read_text()))
    shapes = hf_tensor_shapes(hf_dir)
    produced, unknown = {}, []
    for key, shape in shapes.items():
        names = hf_key_to_neva(key)
        if not names:
            if "rotary" not in key:
                unknown.append(key)
            continue
        if names == ["llm." + LM_HEAD] and cfg.llm.tie_word_embeddings:
            continue
        for name in names:  # the fused gate_up_proj: half the rows each
            produced[name] = (shape[0] // len(names), *shape[1:])
    if unknown:
        raise ValueError(f"{hf_dir}: {len(unknown)} tensor(s) with no neva counterpart, e.g. {unknown[:5]}")
    check_complete(cfg, produced, str(hf_dir))
    tokenizer = None
    if has_tokenizer(hf_dir):
        from neva.data.sentencepiece_tokenizer import load_tokenizer

        tokenizer = load_tokenizer(hf_dir)
        found = tokenizer.get_vocab().get(GLM4V_IMAGE)
        if found != cfg.image_token_id:
            raise ValueError(f"{hf_dir}: tokenizer maps {GLM4V_IMAGE} to {found}, config says {cfg.image_token_id}")
    meta = {
        "source": {"kind": "glm4v", "path": str(hf_dir)},
        "conv_template": TEMPLATE,
        **_pixel_budget(hf_dir),
        **(metadata or {}),
    }
    order = rotary_order(cfg.llm)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for key, tensor in iter_hf_tensors(hf_dir):
            names = hf_key_to_neva(key)
            if not names or (names == ["llm." + LM_HEAD] and cfg.llm.tie_word_embeddings):
                continue
            tensor = cast_floating(tensor, dtype)
            parts = tensor.chunk(len(names)) if len(names) > 1 else (tensor,)
            for name, t in zip(names, parts):
                if any(r in name for r in _ROTATED):
                    t = _permute_heads(t, order)
                yield name, t.contiguous()

    return ImportedParts(cfg, tensors(), tokenizer, meta)


def glm4v_config_dict(cfg: NevaConfig, special_ids: dict[str, int] | None = None) -> dict[str, Any]:
    """The transformers 5 ``config.json`` of a neva GLM-4.1V model (``special_ids``: the tokenizer's ids of the
    image / video begin and end tokens, written where it has them)."""
    v, llm, p = cfg.vision, cfg.llm, cfg.projector
    if v is None or v.kind != "glm4v" or p is None or p.type != "glm4v_merger" or llm.family != "glm4v_text":
        raise ConfigError("only a glm4v tower with its glm4v_merger and a glm4v_text decoder exports as GLM-4.1V")
    if llm.head_dim != llm.hidden_size // llm.num_heads or p.bias or llm.rope_scaling or llm.sliding_window:
        raise ConfigError(
            "a GLM-4.1V export needs head_dim = hidden_size / num_heads, a bias-free merger, no rope scaling and no "
            "sliding window (what Glm4vForConditionalGeneration builds)"
        )
    if v.image_size // v.patch_size != round(v.num_position_embeddings**0.5):
        raise ConfigError(
            f"glm4v num_position_embeddings {v.num_position_embeddings} is not (image_size / patch_size)²: "
            f"{v.image_size} / {v.patch_size}"
        )
    text = dict(
        model_type="glm4v_text", vocab_size=llm.vocab_size, hidden_size=llm.hidden_size,
        intermediate_size=llm.intermediate_size, num_hidden_layers=llm.num_layers, num_attention_heads=llm.num_heads,
        num_key_value_heads=llm.num_kv_heads, rms_norm_eps=llm.rms_norm_eps,
        max_position_embeddings=llm.max_seq_len, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": llm.rope_theta, "mrope_section": llm.mrope_section,
                         "partial_rotary_factor": llm.rotary_percent},
    )  # fmt: skip
    vision = dict(
        model_type="glm4v_vision", depth=v.num_layers, hidden_size=v.hidden_size, num_heads=v.num_heads,
        in_channels=v.num_channels, image_size=v.image_size, patch_size=v.patch_size, rms_norm_eps=v.layer_norm_eps,
        spatial_merge_size=v.spatial_merge_size, temporal_patch_size=v.temporal_patch_size,
        out_hidden_size=llm.hidden_size, intermediate_size=p.intermediate_size, attention_bias=v.qkv_bias,
        hidden_act="silu",
    )  # fmt: skip
    return dict(
        model_type=MODEL_TYPE,
        architectures=["Glm4vForConditionalGeneration"],
        text_config=text,
        vision_config=vision,
        image_token_id=cfg.image_token_id,
        tie_word_embeddings=llm.tie_word_embeddings,
        **(special_ids or {}),
    )


def _hf_tensors(tensors: TensorSource, cfg: NevaConfig, dtype: torch.dtype | None) -> Iterator[tuple[str, Any]]:
    inverse = torch.argsort(rotary_order(cfg.llm))
    gate: dict[str, torch.Tensor] = {}
    for key, tensor in tensor_pairs(tensors):
        if key == "llm." + LM_HEAD and cfg.llm.tie_word_embeddings:
            continue
        tensor = cast_floating(tensor, dtype)
        if any(r in key for r in _ROTATED):
            tensor = _permute_heads(tensor, inverse)
        hf = neva_key_to_hf(key)
        if hf.endswith(_FUSED):  # gate rows, then up rows: yielded once both are here
            if key.endswith("w1.weight") or key.endswith("w3.weight"):
                gate[key] = tensor
                pair = [gate.get(key[: -len("w1.weight")] + w) for w in ("w1.weight", "w3.weight")]
                if all(t is not None for t in pair):
                    yield hf, torch.cat(pair)
            continue
        yield hf, tensor


def export_glm4v(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    conv_template: str | None = None,
) -> Path:
    """A neva GLM-4.1V checkpoint → a directory transformers loads with ``Glm4vForConditionalGeneration``: weights,
    ``config.json`` (with the tokenizer's image / video begin and end ids), the image processor at the model's pixel
    budget (``Glm4vImageProcessorPil``: the checkpoint's ``min_pixels`` / ``max_pixels``, else the family's), the
    tokenizer with the chat template the checkpoint was trained with, and ``generation_config.json`` stopping where
    ``neva.generate`` stops.

    ``dtype`` None exports in the run's half precision (as ``export_llava``)."""
    import transformers

    ckpt = Path(ckpt)
    cfg, meta = load_config(ckpt), load_metadata(ckpt)
    settings = template_settings(meta, conv_template or meta.get("conv_template") or TEMPLATE)
    tokenizer, special = None, {}
    if has_tokenizer(ckpt):
        from neva.data.sentencepiece_tokenizer import load_tokenizer

        tokenizer = load_tokenizer(ckpt)
        vocab = tokenizer.get_vocab()
        special = {field: vocab[token] for field, token in SPECIAL_IDS.items() if token in vocab}
    config = glm4v_config_dict(cfg, special)
    dtype = dtype or export_dtype(meta)
    stored = str(dtype).removeprefix("torch.") if dtype is not None else meta.get("dtype")
    if stored:
        config["dtype"] = stored
    with atomic_directory(out, overwrite) as tmp:
        write_safetensors(tmp, _hf_tensors(iter_tensors(ckpt), cfg, dtype), max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        spec = QwenImageSpec.for_tower(cfg.vision, meta.get("min_pixels"), meta.get("max_pixels"))
        # The PIL backend (as the Qwen-VL exports): the torchvision one needs torchvision.
        transformers.Glm4vImageProcessorPil(
            size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}, patch_size=spec.patch_size,
            temporal_patch_size=spec.temporal_patch_size, merge_size=spec.merge_size,
            image_mean=list(cfg.vision.image_mean), image_std=list(cfg.vision.image_std),
        ).save_pretrained(str(tmp))  # fmt: skip
        write_tokenizer_and_generation(tmp, settings, tokenizer)  # generate stops where neva.generate does
    return Path(out)


# Not built yet: the PEFT adapter's names of the merger and tower saved whole are GLM-4.1V's own modules.
GLM4V_INTEROP = Interop(
    "GLM-4.1V",
    is_glm4v,
    glm4v_parts,
    export_glm4v,
    round_trip_through(glm4v_config_dict, neva_config_from_glm4v),
    peft_adapter=False,
)
