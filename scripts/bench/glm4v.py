"""CPU mode ``--family glm4v``: neva's training step on GLM-4.1V against transformers'
``Glm4vForConditionalGeneration`` with a plain AdamW loop, on the same model, samples and images.

The model: the CPU benchmark's decoder (width 384, 8 layers of 6 heads of 64) as GLM-4.1V's (four norms per layer,
biased q / k / v, untied, M-RoPE [4, 6, 6] over the first half of each head, in GLM's interleaved pairs on the HF
side) behind GLM-4.1V's tower (14 px patches merged 2 × 2, 4 blocks of width 256, an 8 × 8 learned position table
resampled to each image, RMSNorm, a bias-free SwiGLU MLP as wide as the decoder) and its downsampling merger (a SwiGLU
as wide as the decoder's MLP); ``--smoke``: the ``tiny_glm4v`` presets. The samples are ``bench.qwen_vl``'s (one image
of a random size per visual sample, sides of 2 to 8 merged tokens, its patches in the processor's order, its M-RoPE
positions for neva; HF finds its own from ``image_grid_thw`` and ``mm_token_type_ids``). The HF model starts from
neva's initial weights through the export's key table and config (``neva.checkpoint.hf_glm4v``).
"""

from __future__ import annotations

import gc

import torch

from neva.models.config import NevaConfig
from neva.models.presets import LLM_PRESETS, VISION_PRESETS, build_config

GLM4V_VISION = dict(
    kind="glm4v", image_size=112, patch_size=14, hidden_size=256, intermediate_size=384, num_layers=4, num_heads=4,
    hidden_act="silu", num_position_embeddings=64, norm_type="rms", qkv_bias=False,
)  # fmt: skip
GLM4V_TEXT = dict(family="glm4v_text", qkv_bias=True, mrope_section=[4, 6, 6], rotary_percent=0.5)


def model_config(llm: dict, smoke: bool) -> NevaConfig:
    """The benchmark's GLM-4.1V (module docstring)."""
    if smoke:
        return build_config(
            llm=LLM_PRESETS["tiny_glm4v_text"], vision=VISION_PRESETS["tiny_glm4v"], projector_type="glm4v_merger"
        )
    return build_config(llm={**llm, **GLM4V_TEXT}, vision=GLM4V_VISION, projector_type="glm4v_merger")


def hf_model(cfg: NevaConfig, neva_state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``Glm4vForConditionalGeneration`` of ``cfg`` (the export's config) holding ``neva_state``."""
    import transformers

    from neva.checkpoint.hf_glm4v import _hf_tensors, glm4v_config_dict

    config = transformers.Glm4vConfig(**glm4v_config_dict(cfg))
    config._attn_implementation = "sdpa"
    model = transformers.Glm4vForConditionalGeneration(config)
    state = dict(_hf_tensors(neva_state, cfg, None))
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and cfg.llm.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"weight copy into HF failed: missing {missing}, unexpected {result.unexpected_keys}")
    del state
    gc.collect()
    return model


def hf_part(name: str) -> str:
    """Which part of the trainable policy an HF parameter belongs to."""
    if "visual.merger" in name or "visual.downsample" in name:
        return "projector"
    if "visual." in name:
        return "vision"
    return "llm"
