"""Gemma 3 directories (``Gemma3ForConditionalGeneration``) ↔ neva checkpoints: config, weights, tokenizer.

A Gemma 3 model is neva's parts under other names: a SigLIP tower whose features are its ``last_hidden_state``
(after the post-LayerNorm: ``VisionConfig.feature_norm``), the ``gemma3`` projector (average pool to
``mm_tokens_per_image``, RMSNorm, a linear map HF stores transposed) and the ``gemma3`` decoder family
(``neva.families.gemma3``: interleaved sliding / global layers with their own RoPE bases, q / k norms, four
norms per block, scaled embeddings, bidirectional attention inside each image).

Every field of the text config is read, known to change nothing neva computes, or refused by name:
``attn_logit_softcapping`` (SDPA cannot cap scores), ``use_bidirectional_attention`` (the embedding model's text
attention), a non-gelu-tanh activation, a sliding layers' RoPE other than the default. ``final_logit_softcapping`` is
read as the class computes it: ``Gemma3ForConditionalGeneration`` never applies it (only ``Gemma3ForCausalLM`` does),
so the import leaves it off, with a warning (``LLMConfig.final_logit_softcapping`` is the decoder's cap).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint.atomic import atomic_directory
from neva.checkpoint.hf_config import vision_config_from_hf
from neva.checkpoint.hf_files import export_dtype
from neva.checkpoint.hf_import import ImportedParts
from neva.checkpoint.hf_keys import LM_HEAD, VISION_TABLE
from neva.checkpoint.hf_read import cast_floating, check_complete, has_tokenizer, hf_tensor_shapes, iter_hf_tensors
from neva.checkpoint.interop import Interop, own_template, round_trip_through
from neva.checkpoint.neva_format import TensorSource, iter_tensors, load_config, tensor_pairs
from neva.checkpoint.safetensors_io import DEFAULT_MAX_SHARD_BYTES, write_safetensors
from neva.hf_local import model_dir
from neva.models.config import LLMConfig, NevaConfig, ProjectorConfig
from neva.typed import ConfigError

# Gemma 3's chat template (google/gemma-3-*-it tokenizer_config.json): what an export ships when the checkpoint's
# tokenizer has none (neva's ``gemma3`` conversation template renders the same text).
CHAT_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    '    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n"
)
log = logging.getLogger(__name__)
MODEL_TYPE = "gemma3"
MODEL_CLASS = "Gemma3ForConditionalGeneration"
TEMPLATE = "gemma3"
IMAGE_TOKEN = "<image_soft_token>"

# neva (under "llm.") : HF Gemma 3 text model (under the LLM prefix). Gemma's ``post_attention_layernorm`` is the
# attention output's norm, not Llama's pre-feed-forward one.
LLM_TABLE = {
    "tok_embeddings.weight": "embed_tokens.weight",
    "norm.weight": "norm.weight",
    "layers.{}.attention_norm.weight": "layers.{}.input_layernorm.weight",
    "layers.{}.post_attention_norm.weight": "layers.{}.post_attention_layernorm.weight",
    "layers.{}.ffn_norm.weight": "layers.{}.pre_feedforward_layernorm.weight",
    "layers.{}.post_ffn_norm.weight": "layers.{}.post_feedforward_layernorm.weight",
    "layers.{}.attention.wq.weight": "layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "layers.{}.self_attn.o_proj.weight",
    "layers.{}.attention.wq.bias": "layers.{}.self_attn.q_proj.bias",
    "layers.{}.attention.wk.bias": "layers.{}.self_attn.k_proj.bias",
    "layers.{}.attention.wv.bias": "layers.{}.self_attn.v_proj.bias",
    "layers.{}.attention.wo.bias": "layers.{}.self_attn.o_proj.bias",
    "layers.{}.attention.q_norm.weight": "layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "layers.{}.self_attn.k_norm.weight",
    "layers.{}.feed_forward.w1.weight": "layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w3.weight": "layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "layers.{}.mlp.down_proj.weight",
}
PROJECTOR_TABLE = {  # neva (under "projector.") : HF (under the projector prefix); proj is stored transposed
    "norm.weight": "mm_soft_emb_norm.weight",
    "proj.weight": "mm_input_projection_weight",
}
TRANSPOSED = "projector.proj.weight"
# The hub's layout first (what the export writes, and transformers 5 maps on load), then the module paths of a
# transformers 5 model, then what its save_pretrained writes (the tower without ``vision_model.``). Most specific first.
PREFIXES = {
    "vision": ("vision_tower.vision_model.", "model.vision_tower.vision_model.", "vision_tower."),
    "llm": ("language_model.model.", "model.language_model."),
    "projector": ("multi_modal_projector.", "model.multi_modal_projector."),
}
LM_HEAD_KEYS = ("language_model.lm_head.weight", "lm_head.weight")
TABLES = {"vision": VISION_TABLE, "llm": LLM_TABLE, "projector": PROJECTOR_TABLE}

# Text config fields: read into LLMConfig, or inert (no effect on what neva computes; written back by the export as
# transformers' defaults). Anything else is refused by name.
TEXT_READ = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "rope_scaling",
    "rope_theta", "rope_local_base_freq", "sliding_window", "layer_types", "query_pre_attn_scalar", "attention_bias",
    "tie_word_embeddings", "hidden_activation", "final_logit_softcapping", "attn_logit_softcapping",
    "use_bidirectional_attention", "sliding_window_pattern", "model_type",
)  # fmt: skip
TEXT_INERT = (
    "initializer_range", "use_cache", "pad_token_id", "eos_token_id", "bos_token_id", "attention_dropout",
    "architectures", "dtype", "torch_dtype", "transformers_version", "output_hidden_states", "return_dict",
    "output_attentions", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "tokenizer_class", "_name_or_path", "hidden_act", "cache_implementation", "sep_token_id",
    "decoder_start_token_id", "tf_legacy_loss", "pruned_heads", "add_cross_attention", "is_decoder",
    "cross_attention_hidden_size", "finetuning_task", "prefix", "task_specific_params", "tie_encoder_decoder",
    "torchscript", "use_return_dict", "_attn_implementation_autoset", "_sliding_window_pattern",
)  # fmt: skip


def _compile(table: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile("^" + re.escape(hf).replace(r"\{\}", r"(\d+)") + "$"), neva) for neva, hf in table.items()]


_FROM_HF = {part: _compile(table) for part, table in TABLES.items()}


def is_gemma3(hf: dict[str, Any]) -> bool:
    """Whether an HF ``config.json`` dict is a Gemma 3 vision-language model (imported here)."""
    return hf.get("model_type") == MODEL_TYPE


def is_gemma3_checkpoint(ckpt: str | os.PathLike) -> bool:
    """Whether a neva checkpoint holds a Gemma 3 model (its projector is Gemma 3's)."""
    cfg = load_config(ckpt)
    return cfg.projector is not None and cfg.projector.type == "gemma3"


def _rope(text: dict[str, Any]) -> tuple[float, dict | None, float]:
    """(global base, global scaling, local base) of a text config: transformers 5's ``rope_parameters`` per layer
    type, or 4.x's ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
    params = text.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    if not params:
        full = dict(text.get("rope_scaling") or {}, rope_theta=text.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": text.get("rope_local_base_freq", 10_000.0)}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"text_config sliding_attention rope_type {local['rope_type']!r}: only default is built")
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ConfigError(f"text_config full_attention rope_type {kind!r}: neva builds default and linear")
    scaling = None if kind == "default" else {"rope_type": "linear", "factor": float(full["factor"])}
    return float(full.get("rope_theta", 1_000_000.0)), scaling, float(local.get("rope_theta", 10_000.0))


def llm_config_from_gemma3(text: dict[str, Any], tie: bool) -> LLMConfig:
    """The decoder of a Gemma 3 ``text_config`` dict; refuses every field neva would not honour, by name."""
    unknown = sorted(set(text) - set(TEXT_READ) - set(TEXT_INERT))
    if unknown:
        raise ConfigError(f"text_config: field(s) neva does not read for gemma3: {', '.join(unknown)}")
    if text.get("final_logit_softcapping") is not None:
        log.warning(
            "text_config final_logit_softcapping=%s is not applied: Gemma3ForConditionalGeneration never applies it "
            "(only Gemma3ForCausalLM does), and neva imports the model that class computes",
            text["final_logit_softcapping"],
        )
    refusals = {
        "attn_logit_softcapping": text.get("attn_logit_softcapping") is not None,
        "use_bidirectional_attention": bool(text.get("use_bidirectional_attention")),
        "hidden_activation": text.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
    }
    bad = [f"{k}={text.get(k)!r}" for k, refused in refusals.items() if refused]
    if bad:
        raise ConfigError(
            f"text_config: {', '.join(bad)} not supported for gemma3 (score softcaps: SDPA has none; bidirectional "
            "text: the embedding model; only gelu_pytorch_tanh)"
        )
    layers = text["num_hidden_layers"]
    layer_types = text.get("layer_types")
    if layer_types is None:  # transformers' default pattern: every 6th layer global
        pattern = text.get("sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    theta, scaling, local_theta = _rope(text)
    hidden = text["hidden_size"]
    heads = text["num_attention_heads"]
    bias = bool(text.get("attention_bias", False))
    return LLMConfig(
        family="gemma3",
        vocab_size=text["vocab_size"],
        hidden_size=hidden,
        intermediate_size=text["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads", heads),
        head_dim=text.get("head_dim") or hidden // heads,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        max_seq_len=text.get("max_position_embeddings", 131_072),
        tie_word_embeddings=tie,
        qkv_bias=bias,
        o_bias=bias,
        sliding_window=text.get("sliding_window", 4096),
        layer_types=list(layer_types),
        rope_local_theta=local_theta if "sliding_attention" in layer_types else None,
        query_pre_attn_scalar=float(text.get("query_pre_attn_scalar", 256)),
        qk_norm=True,
    )


def neva_config_from_gemma3(hf: dict[str, Any]) -> NevaConfig:
    """NevaConfig of a Gemma 3 ``config.json`` dict (nested ``text_config`` and SigLIP ``vision_config``)."""
    text = dict(hf.get("text_config") or {})
    tie = bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))
    llm = llm_config_from_gemma3(text, tie)
    vision_hf = dict(hf["vision_config"])
    if vision_hf.get("vision_use_head"):
        raise ConfigError("vision_config vision_use_head=true: Gemma 3's tower has no pooling head")
    vision = vision_config_from_hf(vision_hf, select_layer=-1)
    vision = dataclasses.replace(vision, feature_norm=True, image_resample="bilinear")
    projector = ProjectorConfig(
        type="gemma3",
        input_size=vision.hidden_size,
        output_size=llm.hidden_size,
        bias=False,
        tokens_per_image=hf.get("mm_tokens_per_image", 256),
        norm_eps=vision.layer_norm_eps,
    )
    image_token = hf.get("image_token_index", hf.get("image_token_id", 262_144))
    return NevaConfig(llm=llm, vision=vision, projector=projector, image_token_id=image_token)


def hf_key_to_neva(key: str) -> str | None:
    """neva key of a Gemma 3 tensor (None: not one of the model's)."""
    if key in LM_HEAD_KEYS:
        return "llm." + LM_HEAD
    for part, prefixes in PREFIXES.items():
        for prefix in prefixes:
            if key.startswith(prefix):
                rest = key[len(prefix) :]
                for pattern, neva in _FROM_HF[part]:
                    match = pattern.match(rest)
                    if match:
                        return f"{part}." + (neva.replace("{}", match.group(1)) if match.groups() else neva)
                return None
    return None


def neva_key_to_hf(key: str) -> str:
    """The hub layout's key of a neva Gemma 3 tensor."""
    part, rest = key.split(".", 1)
    if part == "llm" and rest == LM_HEAD:
        return LM_HEAD_KEYS[0]
    for neva, hf in TABLES[part].items():
        pattern = re.compile("^" + re.escape(neva).replace(r"\{\}", r"(\d+)") + "$")
        match = pattern.match(rest)
        if match:
            return PREFIXES[part][0] + (hf.replace("{}", match.group(1)) if match.groups() else hf)
    raise KeyError(f"no Gemma 3 key for neva tensor {key}")


# PIL's resampling codes (an image processor config's ``resample``) neva's fits implement.
_RESAMPLE = {2: "bilinear", 3: "bicubic"}


def _with_image_processor(cfg: NevaConfig, hf_dir: Path) -> NevaConfig:
    """The directory's image processor's statistics, resampling and size (``Gemma3ImageProcessor``'s defaults where
    it has none: 0.5 / 0.5, bilinear, the tower's size); pan-and-scan is refused (not built yet)."""
    found = [hf_dir / n for n in ("preprocessor_config.json", "processor_config.json") if (hf_dir / n).is_file()]
    if not found:
        return cfg
    path = found[0]
    pre = json.loads(path.read_text())
    pre = pre.get("image_processor", pre)  # transformers 5 writes the processor's parts into one file
    if pre.get("do_pan_and_scan"):
        raise ConfigError(f"{path}: do_pan_and_scan=true (pan-and-scan crops) is not supported yet")
    resample = pre.get("resample", 2)
    if resample not in _RESAMPLE:
        raise ConfigError(f"{path}: resample {resample} (neva resizes bilinear (2) or bicubic (3))")
    seq = json.loads(path.read_text()).get("image_seq_length", cfg.num_image_tokens)
    if seq != cfg.num_image_tokens:
        raise ConfigError(f"{path}: image_seq_length {seq} != config.json mm_tokens_per_image {cfg.num_image_tokens}")
    size = pre.get("size") or {}
    side = size.get("height", cfg.vision.image_size)
    if size.get("width", side) != side or side != cfg.vision.image_size:
        raise ConfigError(f"{path}: size {size} is not the tower's {cfg.vision.image_size} × {cfg.vision.image_size}")
    vision = dataclasses.replace(
        cfg.vision,
        image_resample=_RESAMPLE[resample],
        image_mean=tuple(pre.get("image_mean", cfg.vision.image_mean)),
        image_std=tuple(pre.get("image_std", cfg.vision.image_std)),
    )
    return dataclasses.replace(cfg, vision=vision)


def _check_image_token(tokenizer: Any, image_token_id: int, hf_dir: Path) -> None:
    found = tokenizer.get_vocab().get(IMAGE_TOKEN)
    if found != image_token_id:
        raise ValueError(f"{hf_dir}: tokenizer maps {IMAGE_TOKEN} to {found}, config says {image_token_id}")


def gemma3_parts(
    hf_dir: str | os.PathLike, *, dtype: torch.dtype | None = None, metadata: dict[str, Any] | None = None
) -> ImportedParts:
    """The import of a Gemma 3 directory up to the writing (its interop's ``import_dir`` writes it; ``neva.evaluate``
    loads an HF directory in memory with it): every tensor's name and shape checked first.

    Raises:
        ConfigError: a field neva does not build. ValueError: tensors that map nowhere, missing model tensors, a
            tokenizer whose image token is not the config's.
    """
    hf_dir = Path(model_dir(hf_dir))
    hf = json.loads((hf_dir / "config.json").read_text())
    cfg = _with_image_processor(neva_config_from_gemma3(hf), hf_dir)
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
    produced = {mapping[k]: shapes[k][::-1] if mapping[k] == TRANSPOSED else shapes[k] for k in mapping}
    check_complete(cfg, produced, str(hf_dir))
    tokenizer = None
    if has_tokenizer(hf_dir):
        from neva.data.sentencepiece_tokenizer import load_tokenizer

        tokenizer = load_tokenizer(hf_dir)
        _check_image_token(tokenizer, cfg.image_token_id, hf_dir)
    meta = {"source": {"kind": "gemma3", "path": str(hf_dir)}, "conv_template": TEMPLATE, **(metadata or {})}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for key, tensor in iter_hf_tensors(hf_dir):
            if key in mapping:
                tensor = tensor.t().contiguous() if mapping[key] == TRANSPOSED else tensor
                yield mapping[key], cast_floating(tensor, dtype)

    return ImportedParts(cfg, tensors(), tokenizer, meta)


def gemma3_config_dict(cfg: NevaConfig) -> dict[str, Any]:
    """The transformers 5 ``config.json`` of a neva Gemma 3 model."""
    if cfg.projector is None or cfg.projector.type != "gemma3" or cfg.llm.family != "gemma3":
        raise ConfigError("only a gemma3 decoder behind a gemma3 projector exports as a Gemma 3 directory")
    llm, v = cfg.llm, cfg.vision
    if llm.final_logit_softcapping is not None:
        raise ConfigError(
            f"final_logit_softcapping={llm.final_logit_softcapping}: Gemma3ForConditionalGeneration never applies a "
            "final logit softcap, so the export would be another model"
        )
    full = {"rope_type": "default", "rope_theta": llm.rope_theta}
    if llm.rope_scaling is not None:
        full = {"rope_type": "linear", "rope_theta": llm.rope_theta, "factor": llm.rope_scaling["factor"]}
    local = {"rope_type": "default", "rope_theta": llm.rope_local_theta or 10_000.0}
    text = dict(
        model_type="gemma3_text", vocab_size=llm.vocab_size, hidden_size=llm.hidden_size,
        intermediate_size=llm.intermediate_size, num_hidden_layers=llm.num_layers,
        num_attention_heads=llm.num_heads, num_key_value_heads=llm.num_kv_heads, head_dim=llm.head_dim,
        rms_norm_eps=llm.rms_norm_eps, max_position_embeddings=llm.max_seq_len,
        rope_parameters={"full_attention": full, "sliding_attention": local}, sliding_window=llm.sliding_window,
        layer_types=list(llm.layer_types or ["full_attention"] * llm.num_layers),
        query_pre_attn_scalar=_int_if_whole(llm.query_pre_attn_scalar or llm.head_dim), attention_bias=llm.qkv_bias,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None,
        tie_word_embeddings=llm.tie_word_embeddings,
    )  # fmt: skip
    vision = dict(
        model_type="siglip_vision_model", hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
        num_hidden_layers=v.num_layers, num_attention_heads=v.num_heads, num_channels=v.num_channels,
        image_size=v.image_size, patch_size=v.patch_size, hidden_act=v.hidden_act, layer_norm_eps=v.layer_norm_eps,
        vision_use_head=False,
    )  # fmt: skip
    return dict(
        model_type=MODEL_TYPE,
        architectures=[MODEL_CLASS],
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=cfg.projector.tokens_per_image,
        image_token_index=cfg.image_token_id,
        tie_word_embeddings=llm.tie_word_embeddings,
    )


def _int_if_whole(x: float) -> float | int:
    """HF's Gemma3TextConfig types ``query_pre_attn_scalar`` as an int (strict): a whole number goes as one."""
    return int(x) if float(x).is_integer() else x


def _hf_tensors(tensors: TensorSource, cfg: NevaConfig, dtype: torch.dtype | None):
    for key, tensor in tensor_pairs(tensors):
        if key == "llm." + LM_HEAD and cfg.llm.tie_word_embeddings:
            continue
        tensor = cast_floating(tensor, dtype)
        yield neva_key_to_hf(key), tensor.t().contiguous() if key == TRANSPOSED else tensor


def export_gemma3(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """A neva Gemma 3 checkpoint → a directory ``Gemma3ForConditionalGeneration`` loads: weights, ``config.json``
    and the tokenizer (with its chat template). ``dtype`` None exports in the run's half precision."""
    from neva.checkpoint.neva_format import load_metadata

    ckpt = Path(ckpt)
    cfg, meta = load_config(ckpt), load_metadata(ckpt)
    config = gemma3_config_dict(cfg)
    with atomic_directory(out, overwrite) as tmp:
        write_safetensors(tmp, _hf_tensors(iter_tensors(ckpt), cfg, dtype or export_dtype(meta)), max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if has_tokenizer(ckpt):
            _write_processor(tmp, cfg, ckpt)
    return Path(out)


def _write_processor(directory: Path, cfg: NevaConfig, ckpt: Path) -> None:
    """The tokenizer (its chat template, else Gemma 3's) and ``Gemma3Processor``'s files: the PIL image processor at
    the tower's size, resampling and statistics, and ``image_seq_length`` the projector's tokens per image."""
    import transformers

    from neva.data.sentencepiece_tokenizer import load_tokenizer

    tokenizer = load_tokenizer(ckpt)
    tokenizer.chat_template = getattr(tokenizer, "chat_template", None) or CHAT_TEMPLATE
    v = cfg.vision
    images = transformers.Gemma3ImageProcessorPil(
        size={"height": v.image_size, "width": v.image_size},
        resample={name: code for code, name in _RESAMPLE.items()}[v.image_resample],
        image_mean=list(v.image_mean),
        image_std=list(v.image_std),
    )
    if all(hasattr(tokenizer, name) for name in ("boi_token", "image_token", "eoi_token")):
        processor = transformers.Gemma3Processor(
            images, tokenizer, chat_template=tokenizer.chat_template, image_seq_length=cfg.num_image_tokens
        )
        processor.save_pretrained(str(directory))
    else:  # a tokenizer without Gemma's image tokens named: the parts alone
        images.save_pretrained(str(directory))
        tokenizer.save_pretrained(str(directory))


# Its projector's linear map is stored transposed under another name (``mm_input_projection_weight``): a PEFT
# adapter saving it whole would need that conversion too.
GEMMA3_INTEROP = Interop(
    "Gemma 3",
    is_gemma3,
    gemma3_parts,
    own_template(export_gemma3),
    round_trip_through(gemma3_config_dict, neva_config_from_gemma3),
    peft_adapter=False,
)
