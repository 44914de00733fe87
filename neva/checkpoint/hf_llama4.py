"""Llama 4 text directories (``Llama4ForCausalLM``, ``model_type`` ``llama4_text``) ↔ neva text-only checkpoints.

Every field of the config is read, known to change nothing neva computes, or refused by name (``FIELDS``). The
tensors are neva's under other names, with three conversions:

- q / k rows: HF rotates interleaved channel pairs (``2i``, ``2i + 1``: complex RoPE), neva the half-split pairs
  (``i``, ``i + head_dim / 2``); each head's rows are reordered even channels first (``_HALF``) on import and back
  on export. Attention reads q·k only, which a channel order shared by q and k leaves unchanged, as it leaves the
  weightless q / k norms and the NoPE layers (whose rows are reordered alike, for one rule);
- experts: HF's ``gate_up_proj`` ``[E, H, 2I]`` (gate columns first) and ``down_proj`` ``[E, I, H]`` are neva's
  ``w1`` / ``w3`` ``[E, I, H]`` and ``w2`` ``[E, H, I]`` transposed;
- the rest 1:1 (``_TABLE``).

``Llama4ForConditionalGeneration`` (``model_type`` ``llama4``) is refused in one line: its vision tower, adapter and
processor tiles are not built (neva.families.llama4).
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
from neva.checkpoint.hf_files import export_dtype
from neva.checkpoint.hf_import import ImportedParts
from neva.checkpoint.hf_read import cast_floating, check_complete, has_tokenizer, hf_tensor_shapes, iter_hf_tensors
from neva.checkpoint.interop import Interop, own_template
from neva.checkpoint.neva_format import TensorSource, iter_tensors, load_config, tensor_pairs
from neva.checkpoint.safetensors_io import DEFAULT_MAX_SHARD_BYTES, write_safetensors
from neva.families.hf_fields import CONFIG_BOOKKEEPING
from neva.hf_local import model_dir
from neva.models.config import LLMConfig, NevaConfig
from neva.typed import ConfigError

MODEL_TYPE = "llama4_text"
MODEL_CLASS = "Llama4ForCausalLM"

# neva key (under "llm.") : HF key of Llama4ForCausalLM, ``{}`` the layer.
_TABLE = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.attention.wq.bias": "model.layers.{}.self_attn.q_proj.bias",
    "layers.{}.attention.wk.bias": "model.layers.{}.self_attn.k_proj.bias",
    "layers.{}.attention.wv.bias": "model.layers.{}.self_attn.v_proj.bias",
    "layers.{}.attention.wo.bias": "model.layers.{}.self_attn.o_proj.bias",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.feed_forward.gate_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.feed_forward.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.feed_forward.down_proj.weight",
    "layers.{}.feed_forward.router.weight": "model.layers.{}.feed_forward.router.weight",
    "layers.{}.feed_forward.shared_expert.w1.weight": "model.layers.{}.feed_forward.shared_expert.gate_proj.weight",
    "layers.{}.feed_forward.shared_expert.w3.weight": "model.layers.{}.feed_forward.shared_expert.up_proj.weight",
    "layers.{}.feed_forward.shared_expert.w2.weight": "model.layers.{}.feed_forward.shared_expert.down_proj.weight",
}
_GATE_UP = "model.layers.{}.feed_forward.experts.gate_up_proj"
_DOWN = "model.layers.{}.feed_forward.experts.down_proj"
_ROTATED = ("attention.wq.", "attention.wk.")


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\{\}", r"(\d+)") + "$")


_FROM_HF = [(_compile(hf), neva) for neva, hf in _TABLE.items()]
_EXPERTS = {"gate_up": _compile(_GATE_UP), "down": _compile(_DOWN)}

# Config fields: read into LLMConfig (``_read``), or refused unless at the value neva computes.
READ = (
    "vocab_size", "hidden_size", "intermediate_size", "intermediate_size_mlp", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
    "rope_parameters", "rope_scaling", "rope_theta", "tie_word_embeddings", "attention_bias", "num_local_experts",
    "num_experts_per_tok", "moe_layers", "interleave_moe_layer_step", "use_qk_norm", "no_rope_layers",
    "no_rope_layer_interval", "attention_chunk_size", "layer_types", "attn_temperature_tuning", "floor_scale",
    "attn_scale",
)  # fmt: skip
# A neva run's own moe_aux_loss_coeff scales its load-balancing loss; transformers adds its own only with
# output_router_logits: neither changes the forward.
INERT = ("router_aux_loss_coef", "output_router_logits", "cache_implementation", *CONFIG_BOOKKEEPING)
NEEDS = {
    "hidden_act": (("silu",), "Llama 4's feed-forwards are SwiGLU (silu)"),
    "attention_dropout": ((0, 0.0), "neva's decoder has no attention dropout"),
    "router_jitter_noise": ((0, 0.0), "router jitter (training-time input noise) is not implemented"),
}


def is_llama4(hf: dict[str, Any]) -> bool:
    """A Llama 4 config: the text model (imported) or the multimodal one (refused by the import, by name)."""
    return hf.get("model_type") in (MODEL_TYPE, "llama4")


def _half_split(w: torch.Tensor, head_dim: int, inverse: bool = False) -> torch.Tensor:
    """Each head's rows (``[heads·head_dim, ...]``) reordered from HF's interleaved pairs to neva's halves (or back)."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    if inverse:
        order = torch.argsort(order)
    shape = w.shape
    return w.reshape(-1, head_dim, *shape[1:])[:, order].reshape(shape).contiguous()


def _rope(hf: dict[str, Any]) -> tuple[float, dict | None]:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 500_000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ConfigError(f"llama4_text rope_type {kind!r}: neva builds default and llama3")
    return theta, (dict(params, rope_type="llama3") if kind == "llama3" else None)


def llm_config_from_llama4(hf: dict[str, Any]) -> LLMConfig:
    """The decoder of a ``llama4_text`` config dict; refuses every field neva would not honour, by name."""
    bad = [
        f"{k}={v!r} (unknown to neva: it may change the computation)"
        for k, v in hf.items()
        if k not in READ + INERT + tuple(NEEDS)
    ]
    bad += [f"{k}={hf[k]!r} ({why})" for k, (ok, why) in NEEDS.items() if k in hf and hf[k] not in ok]
    if bad:
        raise ConfigError(f"{MODEL_TYPE} config: refused field(s): " + "; ".join(bad))
    layers = hf["num_hidden_layers"]
    # transformers' defaults where the dict leaves a list out (Llama4TextConfig.__post_init__)
    rope_flags = hf.get("no_rope_layers") or [
        int((i + 1) % hf.get("no_rope_layer_interval", 4) != 0) for i in range(layers)
    ]
    step = hf.get("interleave_moe_layer_step", 1)
    moe = hf.get("moe_layers")
    moe = list(range(step - 1, layers, step)) if moe is None else moe
    chunk = hf.get("attention_chunk_size", 8192)
    types = hf.get("layer_types") or [
        "chunked_attention" if flag and chunk is not None else "full_attention" for flag in rope_flags
    ]
    if any(t not in ("chunked_attention", "full_attention") for t in types):
        raise ConfigError(f"{MODEL_TYPE} layer_types {types}: only chunked_attention and full_attention are built")
    chunked = "chunked_attention" in types
    theta, scaling = _rope(hf)
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False))
    tuned = hf.get("attn_temperature_tuning", True)
    try:
        return LLMConfig(
            family=MODEL_TYPE,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hidden // heads,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            max_seq_len=hf.get("max_position_embeddings", 131_072),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bias,
            o_bias=bias,
            layer_types=list(types) if chunked else None,
            attention_chunk_size=chunk if chunked else None,
            nope_layers=[i for i, flag in enumerate(rope_flags[:layers]) if not flag] or None,
            qk_l2_norm=bool(hf.get("use_qk_norm", True)),
            attn_temperature_floor_scale=hf.get("floor_scale", 8192) if tuned else None,
            attn_temperature_scale=float(hf.get("attn_scale", 0.1)),
            num_moe_experts=hf.get("num_local_experts", 16),
            moe_router_topk=hf.get("num_experts_per_tok", 1),
            moe_layer_freq=[int(i in moe) for i in range(layers)],
            dense_intermediate_size=hf.get("intermediate_size_mlp", 16384),
            moe_shared_expert_intermediate_size=hf["intermediate_size"],
            moe_router_score_function="sigmoid",
            moe_apply_probs_on_input=True,
        )
    except ValueError as err:
        raise ConfigError(f"{MODEL_TYPE} config: {err}") from None


def neva_config_from_llama4(hf: dict[str, Any]) -> NevaConfig:
    """A text-only NevaConfig of a Llama 4 ``config.json`` dict.

    Raises:
        ConfigError: the multimodal class (its vision side is not built), or a field neva would not honour.
    """
    if hf.get("model_type") == "llama4":
        raise ConfigError(
            "Llama4ForConditionalGeneration: Llama 4's vision tower, adapter and image tiles are not built yet; "
            "its text model (Llama4ForCausalLM, model_type llama4_text) imports"
        )
    llm = llm_config_from_llama4(hf)
    # a text model: the image token is no row of the vocabulary (image_token_id == vocab_size)
    return NevaConfig(llm=llm, vision=None, projector=None, image_token_id=llm.vocab_size)


def _to_neva(key: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]] | None:
    """The neva keys and shapes HF tensor ``key`` becomes (None: it maps nowhere)."""
    for pattern, neva in _FROM_HF:
        match = pattern.match(key)
        if match:
            return [("llm." + neva.format(*match.groups()), shape)]
    match = _EXPERTS["gate_up"].match(key)
    if match:
        e, h, two_i = shape
        base = f"llm.layers.{match.group(1)}.feed_forward.experts."
        return [(base + "w1", (e, two_i // 2, h)), (base + "w3", (e, two_i // 2, h))]
    match = _EXPERTS["down"].match(key)
    if match:
        e, i, h = shape
        return [(f"llm.layers.{match.group(1)}.feed_forward.experts.w2", (e, h, i))]
    return None


def _neva_tensors(key: str, tensor: torch.Tensor, head_dim: int) -> list[tuple[str, torch.Tensor]]:
    names = [name for name, _ in _to_neva(key, tuple(tensor.shape))]
    if key.endswith("gate_up_proj"):
        gate, up = tensor.chunk(2, dim=-1)
        return [(names[0], gate.transpose(1, 2).contiguous()), (names[1], up.transpose(1, 2).contiguous())]
    if key.endswith("experts.down_proj"):
        return [(names[0], tensor.transpose(1, 2).contiguous())]
    if any(part in names[0] for part in _ROTATED):
        tensor = _half_split(tensor, head_dim)
    return [(names[0], tensor)]


def llama4_parts(
    hf_dir: str | os.PathLike, *, dtype: torch.dtype | None = None, metadata: dict[str, Any] | None = None
) -> ImportedParts:
    """The import of a ``Llama4ForCausalLM`` directory up to the writing: every tensor's name and shape checked first.

    Raises:
        ConfigError: the multimodal class, a field neva does not build. ValueError: tensors that map nowhere,
            missing model tensors.
    """
    hf_dir = Path(model_dir(hf_dir))
    cfg = neva_config_from_llama4(json.loads((hf_dir / "config.json").read_text()))
    produced, unknown = {}, []
    for key, shape in hf_tensor_shapes(hf_dir).items():
        mapped = _to_neva(key, tuple(shape))
        if mapped is None:
            unknown.append(key)
        for name, neva_shape in mapped or ():
            if not (name == "llm.output.weight" and cfg.llm.tie_word_embeddings):
                produced[name] = neva_shape
    if unknown:
        raise ValueError(f"{hf_dir}: {len(unknown)} tensor(s) with no neva counterpart, e.g. {unknown[:5]}")
    check_complete(cfg, produced, str(hf_dir))
    tokenizer = None
    if has_tokenizer(hf_dir):
        from neva.data.sentencepiece_tokenizer import load_tokenizer

        tokenizer = load_tokenizer(hf_dir)
    meta = {"source": {"kind": MODEL_TYPE, "path": str(hf_dir)}, **(metadata or {})}
    head_dim = cfg.llm.head_dim

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for key, tensor in iter_hf_tensors(hf_dir):
            for name, out in _neva_tensors(key, tensor, head_dim):
                if name in produced:
                    yield name, cast_floating(out, dtype)

    return ImportedParts(cfg, tensors(), tokenizer, meta)


def llama4_config_dict(cfg: NevaConfig) -> dict[str, Any]:
    """The transformers 5 ``config.json`` of a neva Llama 4 text model."""
    llm = cfg.llm
    if cfg.vision is not None or llm.family != MODEL_TYPE:
        raise ConfigError("only a text-only llama4_text model exports as Llama4ForCausalLM (no vision side yet)")
    rope = {"rope_type": "default", "rope_theta": llm.rope_theta, **(llm.rope_scaling or {})}
    layers = llm.num_layers
    return dict(
        model_type=MODEL_TYPE, architectures=[MODEL_CLASS], vocab_size=llm.vocab_size, hidden_size=llm.hidden_size,
        intermediate_size=llm.intermediate_size, intermediate_size_mlp=llm.dense_width, num_hidden_layers=layers,
        num_attention_heads=llm.num_heads, num_key_value_heads=llm.num_kv_heads, head_dim=llm.head_dim,
        rms_norm_eps=llm.rms_norm_eps, max_position_embeddings=llm.max_seq_len, rope_parameters=rope,
        tie_word_embeddings=llm.tie_word_embeddings, attention_bias=llm.qkv_bias,
        num_local_experts=llm.num_moe_experts, num_experts_per_tok=llm.moe_router_topk,
        moe_layers=[i for i in range(layers) if llm.is_moe_layer(i)], use_qk_norm=llm.qk_l2_norm,
        no_rope_layers=[int(llm.uses_rope(i)) for i in range(layers)],
        attention_chunk_size=llm.attention_chunk_size, layer_types=list(llm.layer_types or ["full_attention"] * layers),
        attn_temperature_tuning=llm.attn_temperature_floor_scale is not None,
        floor_scale=llm.attn_temperature_floor_scale or 8192, attn_scale=llm.attn_temperature_scale,
        hidden_act="silu", attention_dropout=0.0, router_jitter_noise=0.0,
    )  # fmt: skip


def _check_expressible(llm: LLMConfig) -> None:
    """What Llama4ForCausalLM cannot compute, refused before anything is written."""
    problems = {
        "qkv_bias != o_bias": llm.qkv_bias != llm.o_bias,
        "mlp_bias": llm.mlp_bias,
        "qk_norm": llm.qk_norm,
        "sliding_window": llm.sliding_window is not None,
        "a shared expert other than the routed experts' width": (
            llm.moe_shared_expert_intermediate_size != llm.intermediate_size or llm.moe_shared_expert_gate
        ),
        "rotary_percent < 1": llm.rotary_percent != 1.0,
        "M-RoPE": llm.mrope_section is not None,
        "linear attention / an output gate / (1 + w) norms": (
            llm.linear_attention is not None or llm.attention_output_gate or llm.layernorm_zero_centered_gamma
        ),
        "query_pre_attn_scalar / final_logit_softcapping / rope_local_theta": (
            llm.query_pre_attn_scalar is not None
            or llm.final_logit_softcapping is not None
            or llm.rope_local_theta is not None
        ),
    }
    bad = [name for name, refused in problems.items() if refused]
    if bad:
        raise ConfigError(f"Llama4ForCausalLM cannot express: {', '.join(bad)}")


def _hf_tensors(tensors: TensorSource, cfg: NevaConfig, dtype: torch.dtype | None):
    head_dim = cfg.llm.head_dim
    experts: dict[str, dict[str, torch.Tensor]] = {}
    to_hf = {_compile("llm." + neva): hf for neva, hf in _TABLE.items()}
    for key, tensor in tensor_pairs(tensors):
        tensor = cast_floating(tensor, dtype)
        match = re.match(r"^llm\.layers\.(\d+)\.feed_forward\.experts\.(w[123])$", key)
        if match:
            layer = experts.setdefault(match.group(1), {})
            layer[match.group(2)] = tensor
            if len(layer) == 3:  # all three of the layer's stacks read: write HF's two
                gate_up = torch.cat([layer["w1"], layer["w3"]], dim=1).transpose(1, 2).contiguous()
                yield _GATE_UP.format(match.group(1)), gate_up
                yield _DOWN.format(match.group(1)), layer["w2"].transpose(1, 2).contiguous()
                del experts[match.group(1)]
            continue
        if key == "llm.output.weight" and cfg.llm.tie_word_embeddings:
            continue
        for pattern, hf in to_hf.items():
            found = pattern.match(key)
            if found:
                if any(part in key for part in _ROTATED):
                    tensor = _half_split(tensor, head_dim, inverse=True)
                yield hf.format(*found.groups()), tensor
                break
        else:
            raise ValueError(f"neva tensor {key} has no Llama4ForCausalLM counterpart")


def export_llama4(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """A neva Llama 4 text checkpoint → a directory ``Llama4ForCausalLM`` loads: weights, ``config.json`` and the
    tokenizer. ``dtype`` None exports in the run's half precision."""
    from neva.checkpoint.neva_format import load_metadata

    ckpt = Path(ckpt)
    cfg, meta = load_config(ckpt), load_metadata(ckpt)
    config = llama4_config_dict(cfg)
    _check_expressible(cfg.llm)
    with atomic_directory(out, overwrite) as tmp:
        write_safetensors(tmp, _hf_tensors(iter_tensors(ckpt), cfg, dtype or export_dtype(meta)), max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if has_tokenizer(ckpt):
            from neva.data.sentencepiece_tokenizer import load_tokenizer

            load_tokenizer(ckpt).save_pretrained(str(tmp))
    return Path(out)


def _round_trip(arch: NevaConfig) -> str:
    config = llama4_config_dict(arch)
    _check_expressible(arch.llm)
    neva_config_from_llama4(config)
    return config["model_type"]


LLAMA4_INTEROP = Interop(
    "Llama 4 (text)", is_llama4, llama4_parts, own_template(export_llama4), _round_trip, peft_adapter=False
)
