"""CPU mode ``--family llama4``: neva's training step on Llama 4's decoder against transformers' own Llama 4 text
model (``Llama4TextModel``) inside ``LlavaForConditionalGeneration``, with a plain AdamW loop, on the same model,
samples and images.

Llama 4's vision side is not built in neva, so both sides put the decoder behind the benchmark's fixed CLIP-shaped
tower and mlp2x_gelu projector (HF ``LlavaForConditionalGeneration`` builds its text model from a ``llama4_text``
config). The decoder: the CPU benchmark's shapes (8 layers of width 384, 6 heads of 64) as Llama 4's — chunked
attention (128-token chunks) with RoPE and weightless q / k norms in three of every four layers, a global NoPE layer
with temperature tuning in the fourth, MoE and dense layers alternating (8 experts of width 1024, top-1 sigmoid
scores on the experts' inputs, a shared expert of 1024; dense layers 1024 wide); ``--smoke``: ``tiny_llama4``. No
router loss on either side (HF's Llava trains the cross-entropy alone). The HF model starts from neva's initial
weights through the export's key tables (``neva.checkpoint.hf_llama4`` for the decoder, llava-hf's for the rest).
"""

from __future__ import annotations

import dataclasses
import gc

import torch

from bench.data import PAD_ID
from neva.models.config import LLMConfig, NevaConfig
from neva.models.presets import LLM_PRESETS, build_config

LLAMA4_LLM = dict(
    family="llama4_text", head_dim=64, rope_theta=500000.0, layer_types=["chunked_attention"] * 3
    + ["full_attention"] + ["chunked_attention"] * 3 + ["full_attention"], attention_chunk_size=128,
    nope_layers=[3, 7], qk_l2_norm=True, attn_temperature_floor_scale=8192, attn_temperature_scale=0.1,
    num_moe_experts=8, moe_router_topk=1, moe_layer_freq=[0, 1] * 4, dense_intermediate_size=1024,
    moe_shared_expert_intermediate_size=1024, moe_router_score_function="sigmoid", moe_apply_probs_on_input=True,
    moe_aux_loss_coeff=0.0,
)  # fmt: skip


def model_config(llm: dict, vision: dict, smoke: bool) -> NevaConfig:
    """The benchmark's model: ``llm`` (the CPU shapes) as Llama 4's decoder behind the fixed tower, or the tiny one."""
    llm = dict(LLM_PRESETS["tiny_llama4"]) if smoke else {**llm, **LLAMA4_LLM}
    return build_config(llm=llm, vision="tiny" if smoke else vision)


def hf_model(cfg: NevaConfig, neva_state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``LlavaForConditionalGeneration`` of ``cfg`` whose text model is HF's Llama 4, holding ``neva_state``."""
    import transformers

    from neva.checkpoint.hf_config import llava_config_dict
    from neva.checkpoint.hf_keys import MODULE_PREFIXES, neva_key_to_hf
    from neva.checkpoint.hf_llama4 import _hf_tensors, llama4_config_dict

    # the llava-hf fields of the tower and projector (a Llama decoder of the same shapes stands in for the text
    # config, replaced by Llama 4's own)
    t = cfg.llm
    shape = dict(vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_heads=t.num_heads, head_dim=t.head_dim)
    stand_in = dataclasses.replace(cfg, llm=LLMConfig(**shape))
    fields = llava_config_dict(stand_in, pad_token_id=PAD_ID)
    text_only = NevaConfig(llm=cfg.llm, vision=None, projector=None, image_token_id=cfg.llm.vocab_size)
    fields["text_config"] = dict(llama4_config_dict(text_only), pad_token_id=PAD_ID)
    fields["tie_word_embeddings"] = cfg.llm.tie_word_embeddings
    config = transformers.LlavaConfig(**fields)
    config._attn_implementation = "sdpa"
    config.text_config._attn_implementation = "sdpa"
    model = transformers.LlavaForConditionalGeneration(config)
    llm = {k: v for k, v in neva_state.items() if k.startswith("llm.")}
    state = {neva_key_to_hf(k, MODULE_PREFIXES): v for k, v in neva_state.items() if not k.startswith("llm.")}
    for key, tensor in _hf_tensors(llm, text_only, None):
        state["lm_head.weight" if key == "lm_head.weight" else "model.language_model." + key[len("model.") :]] = tensor
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and cfg.llm.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"weight copy into HF failed: missing {missing}, unexpected {result.unexpected_keys}")
    del state
    gc.collect()
    return model
