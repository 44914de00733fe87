"""Flat key tables between neva parameter names and Hugging Face checkpoints.

One table per model part, ``{}`` standing for the layer index. Import finds each part's prefix in the source
checkpoint (current llava-hf, legacy llava-hf, original LLaVA, standalone CLIP / Llama); export writes the legacy
llava-hf layout (the one llava-hf's hub checkpoints use), which transformers 4.3x to 4.5x load as it is and 5.x maps
on load; the current layout would load in 4.52+ only. No tensor is permuted: neva's RoPE uses the same half-split
q/k row layout as HF Llama (HF's own conversion already permuted Meta's interleaved rows).
"""

from __future__ import annotations

import re

VISION_TABLE = {  # neva (under "vision.") : HF CLIP / SigLIP vision (under the vision prefix)
    "patch_embed.weight": "embeddings.patch_embedding.weight",
    "patch_embed.bias": "embeddings.patch_embedding.bias",  # SigLIP only (CLIP's has none; SigLIP has no cls/pre_norm)
    "cls_token": "embeddings.class_embedding",
    "pos_embed.weight": "embeddings.position_embedding.weight",
    "pre_norm.weight": "pre_layrnorm.weight",
    "pre_norm.bias": "pre_layrnorm.bias",
    "post_norm.weight": "post_layernorm.weight",
    "post_norm.bias": "post_layernorm.bias",
    "layers.{}.norm1.weight": "encoder.layers.{}.layer_norm1.weight",
    "layers.{}.norm1.bias": "encoder.layers.{}.layer_norm1.bias",
    "layers.{}.norm2.weight": "encoder.layers.{}.layer_norm2.weight",
    "layers.{}.norm2.bias": "encoder.layers.{}.layer_norm2.bias",
    "layers.{}.attn.q_proj.weight": "encoder.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attn.q_proj.bias": "encoder.layers.{}.self_attn.q_proj.bias",
    "layers.{}.attn.k_proj.weight": "encoder.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attn.k_proj.bias": "encoder.layers.{}.self_attn.k_proj.bias",
    "layers.{}.attn.v_proj.weight": "encoder.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attn.v_proj.bias": "encoder.layers.{}.self_attn.v_proj.bias",
    "layers.{}.attn.o_proj.weight": "encoder.layers.{}.self_attn.out_proj.weight",
    "layers.{}.attn.o_proj.bias": "encoder.layers.{}.self_attn.out_proj.bias",
    "layers.{}.mlp.fc1.weight": "encoder.layers.{}.mlp.fc1.weight",
    "layers.{}.mlp.fc1.bias": "encoder.layers.{}.mlp.fc1.bias",
    "layers.{}.mlp.fc2.weight": "encoder.layers.{}.mlp.fc2.weight",
    "layers.{}.mlp.fc2.bias": "encoder.layers.{}.mlp.fc2.bias",
}

LLM_TABLE = {  # neva (under "llm.") : HF Llama model (under the LLM prefix)
    "tok_embeddings.weight": "embed_tokens.weight",
    "norm.weight": "norm.weight",
    "layers.{}.attention_norm.weight": "layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "layers.{}.post_attention_layernorm.weight",
    "layers.{}.attention.wq.weight": "layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w3.weight": "layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "layers.{}.mlp.down_proj.weight",
    # Biases of the families that have them (Qwen2: q/k/v; HF Llama attention_bias: q/k/v/o, mlp_bias: the MLP).
    "layers.{}.attention.wq.bias": "layers.{}.self_attn.q_proj.bias",
    "layers.{}.attention.wk.bias": "layers.{}.self_attn.k_proj.bias",
    "layers.{}.attention.wv.bias": "layers.{}.self_attn.v_proj.bias",
    "layers.{}.attention.wo.bias": "layers.{}.self_attn.o_proj.bias",
    "layers.{}.feed_forward.w1.bias": "layers.{}.mlp.gate_proj.bias",
    "layers.{}.feed_forward.w3.bias": "layers.{}.mlp.up_proj.bias",
    "layers.{}.feed_forward.w2.bias": "layers.{}.mlp.down_proj.bias",
    # Qwen3's per-head q/k RMSNorms (qk_norm).
    "layers.{}.attention.q_norm.weight": "layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "layers.{}.self_attn.k_norm.weight",
    # Mixtral (num_moe_experts): the router, and the experts in hf_moe's canonical stacked form (reading stacks HF's
    # per-expert tensors into it, writing unstacks it; neva/checkpoint/hf_moe.py).
    "layers.{}.feed_forward.router.weight": "layers.{}.block_sparse_moe.gate.weight",
    "layers.{}.feed_forward.experts.w1": "layers.{}.block_sparse_moe.experts.w1",
    "layers.{}.feed_forward.experts.w3": "layers.{}.block_sparse_moe.experts.w3",
    "layers.{}.feed_forward.experts.w2": "layers.{}.block_sparse_moe.experts.w2",
    # Qwen3.5-MoE's shared expert and its gate.
    "layers.{}.feed_forward.shared_expert.w1.weight": "layers.{}.mlp.shared_expert.gate_proj.weight",
    "layers.{}.feed_forward.shared_expert.w3.weight": "layers.{}.mlp.shared_expert.up_proj.weight",
    "layers.{}.feed_forward.shared_expert.w2.weight": "layers.{}.mlp.shared_expert.down_proj.weight",
    "layers.{}.feed_forward.shared_expert.gate.weight": "layers.{}.mlp.shared_expert_gate.weight",
    # Qwen3.5's linear-attention layers (Gated DeltaNet; neva/models/gated_deltanet.py), in the attention's place.
    **{
        f"layers.{{}}.attention.{name}": f"layers.{{}}.linear_attn.{hf}"
        for name, hf in (
            # HF's fused in_proj_qkv and conv1d, split by neva/checkpoint/hf_linear_attention.py
            ("in_proj_q.weight", "in_proj_q.weight"),
            ("in_proj_k.weight", "in_proj_k.weight"),
            ("in_proj_v.weight", "in_proj_v.weight"),
            ("conv_q", "conv_q.weight"),
            ("conv_k", "conv_k.weight"),
            ("conv_v", "conv_v.weight"),
            ("in_proj_z.weight", "in_proj_z.weight"),
            ("in_proj_b.weight", "in_proj_b.weight"),
            ("in_proj_a.weight", "in_proj_a.weight"),
            ("dt_bias", "dt_bias"),
            ("A_log", "A_log"),
            ("norm.weight", "norm.weight"),
            ("out_proj.weight", "out_proj.weight"),
        )
    },
}

LM_HEAD = "output.weight"  # neva (under "llm."); HF keeps the head outside the LLM prefix

# Projector: neva's nn.Sequential index 2k is HF's linear_{k+1} (GELUs sit at the odd indices).
PROJECTOR_HF = re.compile(r"^linear_(\d+)\.(weight|bias)$")

# Prefixes per part, most specific first. Import takes the first prefix that any key of the source starts with.
VISION_PREFIXES = (
    "model.vision_tower.vision_tower.vision_model.",  # LLaVA-NeXT's own checkpoints (a trained tower)
    "model.vision_tower.vision_model.",
    "model.vision_tower.",
    "vision_tower.vision_model.",
    "vision_tower.",
    "vision_model.",  # standalone CLIPVisionModel / CLIPModel / SiglipModel
    "",  # bare CLIPVisionTransformer; SiglipVisionModel saved by transformers 5
)
LLM_PREFIXES = ("model.language_model.model.", "model.language_model.", "language_model.model.", "model.")
LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
LLAVA_ORIGINAL_PROJECTOR = "model.mm_projector."  # original LLaVA repo: Sequential indices as neva's

EXPORT_VISION_PREFIX = "vision_tower.vision_model."
EXPORT_LLM_PREFIX = "language_model.model."
EXPORT_PROJECTOR_PREFIX = "multi_modal_projector."
EXPORT_LM_HEAD = "language_model.lm_head.weight"
# Per part: the prefix of its keys ("lm_head": the head's whole key, kept outside the LLM prefix).
EXPORT_PREFIXES = {
    "vision": EXPORT_VISION_PREFIX,
    "llm": EXPORT_LLM_PREFIX,
    "projector": EXPORT_PROJECTOR_PREFIX,
    "lm_head": EXPORT_LM_HEAD,
    "anyres": "",  # LLaVA-NeXT's image_newline sits at the top (legacy llava-hf LlavaNext layout)
}
# Module paths inside a LlavaForConditionalGeneration built by transformers 4.52+ / 5.x (what a PEFT adapter
# addresses: PEFT matches module names of the loaded model, not checkpoint keys).
MODULE_PREFIXES = {
    "vision": "model.vision_tower.",
    "llm": "model.language_model.",
    "projector": "model.multi_modal_projector.",
    "lm_head": "lm_head.weight",
    "anyres": "model.",
}

# AnyRes (LLaVA-NeXT): the learned row-end embedding; legacy llava-hf, transformers 5, original LLaVA-NeXT keys.
ANYRES_KEYS = {"image_newline": "anyres.image_newline", "model.image_newline": "anyres.image_newline"}


def _compile(table: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile("^" + re.escape(hf).replace(r"\{\}", r"(\d+)") + "$"), neva) for neva, hf in table.items()]


_VISION_FROM_HF = _compile(VISION_TABLE)
_LLM_FROM_HF = _compile(LLM_TABLE)


def part_key_from_hf(key: str, part: str) -> str | None:
    """neva key (within ``part`` = "vision" | "llm" | "projector") for an HF key already stripped of its prefix."""
    if part == "projector":
        match = PROJECTOR_HF.match(key)
        return f"{2 * (int(match.group(1)) - 1)}.{match.group(2)}" if match else None
    for pattern, neva in _VISION_FROM_HF if part == "vision" else _LLM_FROM_HF:
        match = pattern.match(key)
        if match:
            return neva.replace("{}", match.group(1)) if match.groups() else neva
    return None


def part_key_to_hf(key: str, part: str) -> str:
    """HF key (without prefix) for a neva key within ``part``."""
    if part == "projector":
        index, kind = key.split(".")
        if int(index) % 2:
            raise KeyError(f"projector key {key} is not a Linear layer")
        return f"linear_{int(index) // 2 + 1}.{kind}"
    table = VISION_TABLE if part == "vision" else LLM_TABLE
    match = re.match(r"^layers\.(\d+)\.(.*)$", key)
    if match:
        return table["layers.{}." + match.group(2)].replace("{}", match.group(1))
    return table[key]


def neva_key_to_hf(key: str, prefixes: dict[str, str] = EXPORT_PREFIXES) -> str:
    """Full HF key for a full neva state-dict key: by default in the legacy llava-hf checkpoint layout (read by
    transformers 4.x and 5.x); with ``MODULE_PREFIXES``, the parameter's name in a transformers 5 model."""
    part, rest = key.split(".", 1)
    if part == "llm" and rest == LM_HEAD:
        return prefixes["lm_head"]
    if part == "anyres":
        return prefixes["anyres"] + rest
    return prefixes[part] + part_key_to_hf(rest, part)


def hf_key_to_neva(key: str, prefixes: dict[str, str]) -> str | None:
    """Full neva key for a full HF key, given the detected prefix of each part (see ``detect_prefixes``).

    Returns None for HF keys neva does not keep (CLIP text tower, logit scale, rotary buffers).
    """
    if key in LM_HEAD_KEYS:
        return "llm." + LM_HEAD
    if key in ANYRES_KEYS:
        return ANYRES_KEYS[key]
    for part in ("projector", "vision", "llm"):  # projector/vision first: "model." also prefixes them
        prefix = prefixes.get(part)
        if prefix is None or not key.startswith(prefix):
            continue
        rest = key[len(prefix) :]
        if part == "projector" and prefix == LLAVA_ORIGINAL_PROJECTOR:
            # LLaVA's `linear` projector is a bare nn.Linear (`mm_projector.weight`); neva's is Sequential's layer 0.
            return "projector." + (rest if rest[:1].isdigit() else "0." + rest)
        neva = part_key_from_hf(rest, part)
        if neva is not None:
            return f"{part}.{neva}"
    return None


def detect_prefixes(
    keys: list[str] | set[str], parts: tuple[str, ...] = ("vision", "projector", "llm")
) -> dict[str, str]:
    """Which prefix each part uses in a checkpoint (keys of the source ``state_dict``)."""
    keys = list(keys)
    found: dict[str, str] = {}
    probes = {
        "vision": (VISION_PREFIXES, "embeddings.patch_embedding.weight"),
        "llm": (LLM_PREFIXES, "embed_tokens.weight"),
        "projector": ((*PROJECTOR_PREFIXES, LLAVA_ORIGINAL_PROJECTOR), None),
    }
    for part in parts:
        candidates, probe = probes[part]
        for prefix in candidates:
            if probe is not None and prefix + probe in keys:
                found[part] = prefix
                break
            if probe is None and any(k.startswith(prefix) for k in keys):
                found[part] = prefix
                break
    return found
