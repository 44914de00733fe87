"""NeMo NeVA's config keys and what each means in neva: the one table behind command-line compatibility.

Every key of NeMo 1.x's ``neva_config.yaml`` / ``neva_finetune.yaml`` has an entry (tests check the list against
the real files, kept under ``tests/nemo/``): the same key in neva, an alias rewritten to neva's key, a value neva
always has (accepted when the command line asks for that value), a value derived from another key, a switch with no
effect on what is trained (accepted with a warning), or a key neva does not support (refused, saying why).

``rewrite_overrides`` applies the table to Hydra command-line overrides *before* Hydra sees them, because Hydra's
struct mode refuses an unknown key with "use +key" and would hide the explanation. ``rewrite_config_keys`` applies it,
through ``rewrite_overrides``, to NeMo keys that YAML files bring (``neva.config.apply_nemo_keys``). docs/NEMO.md is
the same table in prose.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from neva.typed import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Same:
    """The key exists in neva under the same name (``note``: where the meaning differs in detail)."""

    note: str = ""


@dataclass(frozen=True)
class Alias:
    """Rewritten to ``target``; ``convert`` maps the value text (None from it drops the override)."""

    target: str
    note: str = ""
    convert: Callable[[str], str | None] | None = None


@dataclass(frozen=True)
class Fixed:
    """neva always behaves as NeMo does with one of ``accepted`` (lower-case value texts); other values are refused."""

    accepted: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Derived:
    """neva computes this value from ``source``; setting it is refused, naming what to set instead."""

    source: str


@dataclass(frozen=True)
class Ignored:
    """A switch with no effect on what is trained (kernel choice, logging); accepted and dropped with a warning."""

    reason: str


@dataclass(frozen=True)
class Unsupported:
    reason: str


Entry = Same | Alias | Fixed | Derived | Ignored | Unsupported

_LLM_ARCH = "++model.mm_cfg.llm.arch_overrides."
_VISION_ARCH = "++model.mm_cfg.vision_encoder.arch_overrides."
_ARCH_NOTE = "overrides the architecture of llm.preset / llm.from_pretrained (ignored with model.restore_from_path)"
_NO_NEMO = (
    ".nemo files are not read or written; neva checkpoints are directories (exp_dir/final); convert to HF first "
    "(NeMo's scripts/checkpoint_converters) and import with `python -m neva.convert hf-to-neva`"
)
_FUSION = "a Megatron kernel/communication switch; neva's kernels are PyTorch's (SDPA, fused AdamW, model.compile)"
_FP8 = "FP8 training is not implemented (bf16 or fp32 only: trainer.precision)"


def _rope_linear(value: str) -> str | None:
    factor = yaml.safe_load(value)
    return None if factor is None else f"{{rope_type:linear,factor:{factor}}}"


def _square_crop(value: str) -> str | None:
    size = yaml.safe_load(value)
    if isinstance(size, int):
        return str(size)
    if isinstance(size, list) and len(size) == 2 and size[0] == size[1]:
        return str(size[0])
    raise ConfigError(f"model.mm_cfg.vision_encoder.crop_size={value}: neva's towers take square images only")


# Keys whose whole subtree has one meaning.
SUBTREES: dict[str, Entry] = {
    "exp_manager.ema": Unsupported("weight EMA is not implemented"),
    "model.tokenizer": Unsupported(
        "the tokenizer comes from model.mm_cfg.llm.from_pretrained (HF tokenizer files) or the checkpoint "
        "(model.restore_from_path); sentencepiece/megatron tokenizer settings have no meaning there"
    ),
    "model.energon": Unsupported(
        "Megatron Energon datasets are not read; neva reads LLaVA JSON/JSONL and WebDataset .tar shards "
        "(model.data.data_path; `python -m neva.data.make_shards`)"
    ),
    "model.nsys_profile": Unsupported(
        "no built-in nsys range; profile the whole run under `nsys profile` or use scripts/benchmark.py"
    ),
}

NEMO_KEYS: dict[str, Entry] = {
    "name": Ignored("the label of NeMo's config file; neva names a run by exp_manager.name"),
    "restore_from_path": Unsupported(
        "NeMo's top-level restore_from_path loads a .nemo for its evaluation scripts; neva starts training from "
        "model.restore_from_path (a neva checkpoint) and evaluates with `python -m neva.evaluate --ckpt`"
    ),
    # trainer
    "trainer.devices": Same(),
    "trainer.num_nodes": Same(),
    "trainer.accelerator": Same(),
    "trainer.precision": Same("bf16 / 16 / 32 and the -mixed forms; O2 with model.megatron_amp_O2=true"),
    "trainer.logger": Fixed(
        ("false",), "loggers come from exp_manager.create_tensorboard_logger / create_wandb_logger (as in NeMo)"
    ),
    "trainer.enable_checkpointing": Fixed(
        ("false",), "checkpoints come from exp_manager.checkpoint_callback_params (as in NeMo)"
    ),
    "trainer.use_distributed_sampler": Fixed(("false",), "neva's sampler shards the data by data-parallel rank"),
    "trainer.max_epochs": Same(),
    "trainer.max_steps": Same(),
    "trainer.log_every_n_steps": Same(),
    "trainer.val_check_interval": Same(),
    "trainer.check_val_every_n_epoch": Fixed(
        ("null", "none"), "neva validates every trainer.val_check_interval steps, across epoch boundaries"
    ),
    "trainer.limit_val_batches": Same(),
    "trainer.limit_test_batches": Unsupported("neva.train has no test loop; run `python -m neva.evaluate`"),
    "trainer.accumulate_grad_batches": Fixed(
        ("1",),
        "gradient accumulation is automatic, as in NeMo ('do not modify'): each optimizer step runs "
        "model.global_batch_size / (model.micro_batch_size × data-parallel size) micro-batches; "
        "set model.global_batch_size instead",
    ),
    "trainer.gradient_clip_val": Same(),
    "trainer.benchmark": Fixed(("false",), "cuDNN autotuning is not exposed"),
    "trainer.enable_model_summary": Fixed(("false",), "neva logs its own parameter counts"),
    # exp_manager
    "exp_manager.explicit_log_dir": Alias(
        "exp_manager.exp_dir", "neva's exp_dir already is the run's directory (no name/version nesting)"
    ),
    "exp_manager.exp_dir": Same(
        "the run writes into exp_dir itself (NeMo writes exp_dir/name/version unless explicit_log_dir is set)"
    ),
    "exp_manager.name": Same(),
    "exp_manager.create_wandb_logger": Same(),
    "exp_manager.wandb_logger_kwargs.project": Alias("++exp_manager.wandb_logger_kwargs.project"),
    "exp_manager.wandb_logger_kwargs.name": Alias("++exp_manager.wandb_logger_kwargs.name"),
    "exp_manager.resume_if_exists": Same(),
    "exp_manager.resume_ignore_no_checkpoint": Fixed(("true",), "a run without a checkpoint starts fresh"),
    "exp_manager.resume_from_checkpoint": Same(),
    "exp_manager.create_checkpoint_callback": Fixed(("true",), "step checkpoints are what resume needs"),
    "exp_manager.checkpoint_callback_params.monitor": Unsupported(
        "neva keeps the newest step checkpoints (resume needs the newest), not the best by a metric; see save_top_k"
    ),
    "exp_manager.checkpoint_callback_params.save_top_k": Same(
        "keeps the newest k step checkpoints (NeMo: the best k by monitor); -1 all, 0 only last.ckpt"
    ),
    "exp_manager.checkpoint_callback_params.mode": Unsupported("no metric is monitored (see monitor)"),
    "exp_manager.checkpoint_callback_params.always_save_nemo": Unsupported(_NO_NEMO),
    "exp_manager.checkpoint_callback_params.save_nemo_on_train_end": Unsupported(
        "neva always writes the consolidated checkpoint exp_dir/final at the end; " + _NO_NEMO
    ),
    "exp_manager.checkpoint_callback_params.filename": Unsupported(
        "step checkpoints are named step=N.ckpt (and last.ckpt), which resume and conversion rely on"
    ),
    "exp_manager.checkpoint_callback_params.model_parallel_size": Derived(
        "model.tensor_model_parallel_size × model.pipeline_model_parallel_size"
    ),
    # model: batch, parallelism, starting point
    "model.precision": Derived("trainer.precision"),
    "model.micro_batch_size": Same(),
    "model.global_batch_size": Same(),
    "model.tensor_model_parallel_size": Same(),
    "model.pipeline_model_parallel_size": Same(),
    "model.context_parallel_size": Same(
        "each sequence split over `cp` ranks (load-balanced chunks, keys/values all-gathered, tower inputs shared "
        "out, a native-resolution tower's items by patches); composes with DP (FSDP2 / DDP), TP + SP, PP, MoE "
        "decoders, EP (expert groups drawn from dp × cp), bf16 O2, native-resolution (Qwen-VL) towers and the DPO stage "
        '(docs/DISTRIBUTED.md, "Context parallelism")'
    ),
    "model.virtual_pipeline_model_parallel_size": Same(),
    "model.restore_from_path": Same("a neva checkpoint directory (NeMo: a .nemo file; " + _NO_NEMO + ")"),
    "model.mm_cfg.llm.from_pretrained": Same("a local HF Llama directory (NeMo: a .nemo file)"),
    "model.mm_cfg.llm.freeze": Same(),
    "model.mm_cfg.llm.model_type": Same("selects model.data.conv_template when that is null, as in NeMo"),
    "model.mm_cfg.vision_encoder.from_pretrained": Same("a local HF CLIP or SigLIP directory"),
    "model.mm_cfg.vision_encoder.from_hf": Fixed(("true",), "the vision encoder is read from HF CLIP / SigLIP files"),
    "model.mm_cfg.vision_encoder.patch_dim": Alias(_VISION_ARCH + "patch_size", _ARCH_NOTE),
    "model.mm_cfg.vision_encoder.crop_size": Alias(_VISION_ARCH + "image_size", _ARCH_NOTE, _square_crop),
    "model.mm_cfg.vision_encoder.hidden_size": Derived(
        "the tower's config (model.mm_cfg.vision_encoder.from_pretrained or .preset)"
    ),
    "model.mm_cfg.vision_encoder.vision_select_layer": Same(),
    # SigLIP towers and NeMo's VILA projector (neva_mixtral_config.yaml: class_token_length 0, mlp_downsample)
    "model.mm_cfg.vision_encoder.class_token_length": Same(
        "checked against the tower at start: 1 for CLIP, 0 for SigLIP (no class token); the tower itself comes from "
        "vision_encoder.from_pretrained or .preset"
    ),
    "model.mm_cfg.vision_encoder.freeze": Same(),
    "model.mm_cfg.pretrain_mm_mlp_adapter": Same("LLaVA's mm_projector.bin / safetensors projector weights"),
    "model.mm_cfg.mm_mlp_adapter_type": Same(
        "linear, identity, mlp<N>x_gelu or mlp_downsample (NeMo's VILA 2x2 merge: ceil(side / 2)² tokens per image; "
        "no HF export)"
    ),
    "model.mm_cfg.use_im_start_end": Fixed(
        ("false",), "no <im_start>/<im_end> tokens (LLaVA-1.5 and NeMo's Llama recipes use none)"
    ),
    # model: LLM architecture (neva's Llama: RMSNorm, SwiGLU, RoPE, no bias, no dropout)
    "model.mcore_gpt": Ignored("neva's decoder is its own PyTorch module; which Megatron GPT class has no meaning"),
    "model.encoder_seq_length": Alias(_LLM_ARCH + "max_seq_len", _ARCH_NOTE),
    "model.max_position_embeddings": Derived("model.encoder_seq_length (neva: the LLM's max_seq_len)"),
    "model.position_embedding_type": Fixed(("rope",), "neva's decoder is Llama (RoPE)"),
    "model.num_layers": Alias(_LLM_ARCH + "num_layers", _ARCH_NOTE),
    "model.hidden_size": Alias(_LLM_ARCH + "hidden_size", _ARCH_NOTE),
    "model.ffn_hidden_size": Alias(_LLM_ARCH + "intermediate_size", _ARCH_NOTE),
    "model.num_attention_heads": Alias(_LLM_ARCH + "num_heads", _ARCH_NOTE),
    "model.init_method_std": Unsupported(
        "fresh weights are initialised as HF Llama does (normal, std 0.02); LLMs start from pretrained weights"
    ),
    "model.use_scaled_init_method": Unsupported("see model.init_method_std"),
    "model.hidden_dropout": Fixed(("0", "0.0", "0."), "neva's decoder has no dropout (NeVA and LLaVA train with 0)"),
    "model.attention_dropout": Fixed(("0", "0.0", "0."), "neva's decoder has no dropout"),
    "model.ffn_dropout": Fixed(("0", "0.0", "0."), "neva's decoder has no dropout"),
    "model.kv_channels": Alias(_LLM_ARCH + "head_dim", _ARCH_NOTE),
    "model.apply_query_key_layer_scaling": Ignored(
        "Megatron's fp16 overflow guard; the attention probabilities are mathematically the same"
    ),
    "model.normalization": Fixed(("rmsnorm",), "neva's decoder is Llama (RMSNorm)"),
    "model.layernorm_epsilon": Alias(_LLM_ARCH + "rms_norm_eps", _ARCH_NOTE),
    "model.do_layer_norm_weight_decay": Fixed(("false",), "norms and biases are never weight-decayed"),
    "model.pre_process": Fixed(("true",), "pipeline stages get their embedding/head from neva's layout"),
    "model.post_process": Fixed(("true",), "pipeline stages get their embedding/head from neva's layout"),
    "model.persist_layer_norm": Ignored(_FUSION),
    "model.bias": Fixed(
        ("false",),
        "NeMo's bias=true biases every linear layer (q/k/v, o, fc1, fc2: HF Llama attention_bias + mlp_bias), not "
        "Qwen2's q/k/v-only biases; neva's biased decoders come from llm.from_pretrained's HF config or llm.preset "
        "(arch_overrides qkv_bias / o_bias / mlp_bias)",
    ),
    "model.activation": Fixed(("fast-swiglu", "swiglu"), "neva's decoder is Llama (SwiGLU)"),
    "model.headscale": Fixed(("false",), "not part of Llama"),
    "model.transformer_block_type": Fixed(("pre_ln",), "neva's decoder is Llama (pre-norm)"),
    "model.normalize_attention_scores": Fixed(("true",), "attention scores are scaled by 1/sqrt(head_dim)"),
    "model.rotary_percentage": Fixed(("1", "1.0"), "RoPE covers the whole head dimension (Llama)"),
    "model.attention_type": Fixed(("multihead",), "causal multi-head (or grouped-query) attention only"),
    "model.share_embeddings_and_output_weights": Alias(_LLM_ARCH + "tie_word_embeddings", _ARCH_NOTE),
    "model.overlap_p2p_comm": Ignored(_FUSION),
    "model.batch_p2p_comm": Ignored(_FUSION),
    "model.seq_len_interpolation_factor": Alias(
        _LLM_ARCH + "rope_scaling", "linear RoPE scaling by this factor; " + _ARCH_NOTE, _rope_linear
    ),
    "model.num_query_groups": Alias(_LLM_ARCH + "num_kv_heads", _ARCH_NOTE),
    "model.use_flash_attention": Ignored("attention runs through PyTorch SDPA, which picks flash kernels itself"),
    "model.activations_checkpoint_granularity": Same(),
    "model.activations_checkpoint_method": Fixed(
        ("null", "none", "uniform"),
        "full checkpointing covers every layer uniformly (method 'block' is not implemented)",
    ),
    "model.activations_checkpoint_num_layers": Same(),
    "model.num_micro_batches_with_partial_activation_checkpoints": Fixed(
        ("null", "none"), "partial activation checkpointing is not implemented"
    ),
    "model.activations_checkpoint_layers_per_pipeline": Fixed(
        ("null", "none"), "per-pipeline-stage checkpointing counts are not implemented"
    ),
    "model.sequence_parallel": Same(),
    "model.native_amp_init_scale": Unsupported("fp16 loss scaling uses PyTorch's GradScaler defaults; use bf16"),
    "model.native_amp_growth_interval": Unsupported("fp16 loss scaling uses PyTorch's GradScaler defaults"),
    "model.hysteresis": Unsupported("fp16 loss scaling uses PyTorch's GradScaler defaults"),
    "model.fp32_residual_connection": Fixed(("false",), "residuals stay in the compute dtype"),
    "model.fp16_lm_cross_entropy": Fixed(("false",), "the loss is always computed in fp32"),
    "model.masked_softmax_fusion": Ignored(_FUSION),
    "model.bias_dropout_add_fusion": Ignored(_FUSION),
    "model.use_cpu_initialization": Ignored("models are built on the meta device and materialised per rank"),
    "model.onnx_safe": Ignored("no ONNX export; export goes to HF (`python -m neva.convert neva-to-hf`)"),
    "model.gradient_accumulation_fusion": Ignored(_FUSION),
    "model.openai_gelu": Fixed(("false",), "neva's decoder uses SwiGLU"),
    "model.bias_activation_fusion": Ignored(_FUSION),
    "model.megatron_legacy": Fixed(("false",), "no legacy Megatron layout"),
    "model.transformer_engine": Fixed(("false",), "Transformer Engine is not used"),
    "model.fp8": Fixed(("false",), _FP8),
    "model.fp8_e4m3": Unsupported(_FP8),
    "model.fp8_hybrid": Unsupported(_FP8),
    "model.fp8_margin": Unsupported(_FP8),
    "model.fp8_interval": Unsupported(_FP8),
    "model.fp8_amax_history_len": Unsupported(_FP8),
    "model.fp8_amax_compute_algo": Unsupported(_FP8),
    "model.use_emha": Fixed(("false",), "NeMo notes it is not supported either"),
    "model.megatron_amp_O2": Same(),
    "model.async_grad_allreduce": Ignored(_FUSION),
    "model.grad_allreduce_chunk_size_mb": Ignored(_FUSION),
    "model.grad_div_ar_fusion": Ignored(_FUSION),
    "model.seed": Same(),
    "model.resume_from_checkpoint": Alias("exp_manager.resume_from_checkpoint", "NeMo interpolates one into the other"),
    "model.apex_transformer_log_level": Ignored("no apex"),
    "model.gradient_as_bucket_view": Ignored(_FUSION),
    # model.data
    "model.data.packed_sequence": Alias(
        "model.data.packing",
        "neva packs each micro-batch's samples online (first-fit into seq_length rows); no offline packed files",
    ),
    "model.data.num_workers": Same(),
    "model.data.dataloader_type": Fixed(
        ("cyclic",), "neva's sampler reshuffles every epoch and resumes mid-epoch (NeMo's cyclic)"
    ),
    "model.data.data_path": Same(),
    "model.data.global_batch_size": Alias("model.global_batch_size", "NeMo interpolates it from model.*"),
    "model.data.micro_batch_size": Alias("model.micro_batch_size", "NeMo interpolates it from model.*"),
    "model.data.concat_sampling_probabilities": Same(),
    "model.data.lazy_preprocess": Fixed(("true",), "samples are always tokenized lazily in the loader"),
    "model.data.is_multimodal": Fixed(("true",), "text-only samples are mixed in per record, as LLaVA does"),
    "model.data.media_type": Same(
        'image or video; records are read per record (a "video" key makes a video sample), video requires a model '
        "that takes video"
    ),
    "model.data.sep_image_conv_front": Fixed(
        ("false",), "<image> placement is model.data.image_token_placement (front = LLaVA's)"
    ),
    "model.data.conv_template": Same("null = from model.mm_cfg.llm.model_type, as NeMo's default interpolation"),
    "model.data.image_folder": Same(),
    "model.data.image_aspect_ratio": Same("square, pad or keep"),
    "model.data.image_token_len": Derived(
        "the vision encoder: (image_size / patch_size)², plus one with vision_select_feature=cls_patch (CLIP); "
        "ceil(image_size / patch_size / 2)² with mm_mlp_adapter_type=mlp_downsample"
    ),
    # model.optim
    "model.optim.name": Same("adamw (fused_adam and adam mean AdamW, as NeMo's fused_adam)"),
    "model.optim.lr": Same(),
    "model.optim.weight_decay": Same(),
    "model.optim.betas": Same(),
    "model.optim.sched.name": Same("CosineAnnealing only"),
    "model.optim.sched.warmup_steps": Same(),
    "model.optim.sched.constant_steps": Same(),
    "model.optim.sched.min_lr": Same(),
}

# Mixture of experts (NeMo's neva_mixtral_config.yaml: Megatron-Core's MoE keys; neva/models/moe.py,
# neva/parallel/expert_parallel.py). NeMo's z-loss (moe_z_loss_coeff) and neva's choice of load-balancing formula
# (moe_aux_loss_formula) are architecture keys: model.mm_cfg.llm.arch_overrides.
_MOE = "MoE decoder (neva/models/moe.py); " + _ARCH_NOTE
NEMO_KEYS.update(
    {
        "model.num_moe_experts": Alias(_LLM_ARCH + "num_moe_experts", _MOE),
        "model.moe_router_topk": Alias(_LLM_ARCH + "moe_router_topk", _MOE),
        "model.moe_aux_loss_coeff": Alias(
            _LLM_ARCH + "moe_aux_loss_coeff",
            "Megatron-Core's Switch load-balancing loss per layer, summed over layers, mean over micro-batches; "
            + _MOE,
        ),
        "model.expert_model_parallel_size": Same(
            "carved from data parallelism (dp × cp under context parallelism), as Megatron-Core"
        ),
        "model.moe_token_dispatcher_type": Fixed(
            ("alltoall",), "under expert parallelism tokens travel by all-to-all (NeMo's Mixtral setting)"
        ),
        "model.moe_grouped_gemm": Ignored(
            "the experts always run as one grouped GEMM where torch has one for the device (CUDA bf16, sm90+), "
            "elsewhere as a loop over experts: the same numbers either way"
        ),
        "model.rotary_base": Alias(_LLM_ARCH + "rope_theta", _ARCH_NOTE),
        "model.make_vocab_size_divisible_by": Ignored(
            "the vocabulary size comes from the tokenizer or the checkpoint (HF import pads it: pad_vocab_multiple)"
        ),
    }
)

# NeMo's mm_cfg.llm.model_type → neva's conversation template (NeMo's conv_template defaults to the model_type).
MODEL_TYPE_TEMPLATES: dict[str, str] = {
    "v1": "vicuna_v1",
    "vicuna_v1": "vicuna_v1",
    "llama_2": "llama_2",
    "llama_3": "llama_3",
    "mistral": "mistral",
    "chatml": "chatml",
    "plain": "plain",
}


def template_for_model_type(model_type: str) -> str:
    """The conversation template NeMo picks for ``model.mm_cfg.llm.model_type``."""
    if model_type not in MODEL_TYPE_TEMPLATES:
        raise ConfigError(
            f"model.mm_cfg.llm.model_type={model_type!r} has no conversation template in neva "
            f"(nvgpt and NeMo's other NVIDIA-internal formats are not supported); choose one of "
            f"{sorted(MODEL_TYPE_TEMPLATES)} or set model.data.conv_template"
        )
    return MODEL_TYPE_TEMPLATES[model_type]


def lookup(key: str) -> Entry | None:
    """The table entry for a dotted NeMo key (a subtree's entry covers its keys); None = not a NeMo key."""
    if key in NEMO_KEYS:
        return NEMO_KEYS[key]
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        if (prefix := ".".join(parts[:n])) in SUBTREES:
            return SUBTREES[prefix]
    return None


def split_override(override: str) -> tuple[str, str, str | None]:
    """``'+a.b=1'`` → ``('+', 'a.b', '1')``; a deletion ``~a.b`` has no value."""
    prefix = override[: len(override) - len(override.lstrip("+~"))]
    key, eq, value = override[len(prefix) :].partition("=")
    return prefix, key, value if eq else None


def rewrite_overrides(overrides: list[str]) -> list[str]:
    """Apply the NeMo key table to Hydra command-line ``overrides``; options (``--help``, ``-m``) pass unchanged.

    Raises:
        ConfigError: a NeMo key neva does not support (with the reason), a value neva cannot honour, a derived key,
            or an alias that contradicts its target given in the same command line.
    """
    out: list[str] = []
    given: dict[str, tuple[str, str, bool]] = {}  # neva key → (value, the override that set it, via an alias)
    for override in overrides:
        if override.startswith("-"):
            out.append(override)
            continue
        _, key, value = split_override(override)
        entry = lookup(key)
        if entry is None or isinstance(entry, Same) or value is None:
            new = override
        elif isinstance(entry, Alias):
            converted = entry.convert(value) if entry.convert else value
            if converted is None:
                log.info("%s: dropped (%s)", override, entry.note)
                continue
            new = f"{entry.target}={converted}"
            log.info("NeMo key %s → %s", override, new)
        elif isinstance(entry, Fixed):
            if value.strip("'\"").lower() not in entry.accepted:
                raise ConfigError(
                    f"{key}={value} is not supported: {entry.reason} (neva accepts only {' / '.join(entry.accepted)})"
                )
            continue
        elif isinstance(entry, Derived):
            raise ConfigError(f"{key} is derived from {entry.source} in neva; set that instead")
        elif isinstance(entry, Ignored):
            log.warning("%s has no effect in neva: %s", override, entry.reason)
            continue
        else:
            raise ConfigError(f"{key} (a NeMo NeVA key) is not supported: {entry.reason}; see docs/NEMO.md")
        # An alias and its target in one command line must agree (Hydra would silently keep the last).
        _, neva_key, neva_value = split_override(new)
        aliased = new != override
        if neva_key in given and given[neva_key][0] != neva_value and (aliased or given[neva_key][2]):
            raise ConfigError(f"{given[neva_key][1]} and {override} set {neva_key} to different values")
        given[neva_key] = (neva_value or "", override, aliased)
        out.append(new)
    return out


def override_text(value: Any) -> str:
    """``value`` (as read from YAML) written as a Hydra command-line override value that parses back to it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_text(v)}" for k, v in value.items()) + "}"
    # Hydra's quoted strings: a quote is escaped, and so is each backslash before a quote (the closing one included).
    text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", str(value))
    trailing = len(text) - len(text.rstrip("\\"))
    return "'" + text + "\\" * trailing + "'"


def rewrite_config_keys(found: dict[str, Any]) -> dict[str, Any]:
    """Apply the table to NeMo keys found in composed YAML files (dotted key → value) exactly as on the command line:
    each becomes the override that would set it and goes through ``rewrite_overrides`` (the same notices, refusals
    and messages), so a NeMo key means one thing wherever it is written.

    Returns:
        The neva keys and values the aliases set; keys accepted with a fixed value, dropped or ignored give none.

    Raises:
        ConfigError: as ``rewrite_overrides``.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    rewritten = rewrite_overrides([f"{key}={override_text(value)}" for key, value in found.items()])
    parsed = OverridesParser.create().parse_overrides(rewritten)
    return {o.key_or_group: o.value() for o in parsed}
