"""CPU mode ``--family gemma3``: neva's training step against transformers' ``Gemma3ForConditionalGeneration`` with a
plain AdamW loop, on the same model, samples and images.

The model: the CPU benchmark's decoder as Gemma 3 (its 64-wide heads with q / k norms, four norms per block, scaled
and tied embeddings, tanh-GELU, a 5 : 1 pattern of sliding-window (128 tokens, RoPE base 1e4) and global (1e6)
layers, the attention scale of ``query_pre_attn_scalar``) behind the benchmark's tower as Gemma 3's SigLIP (its
post-LayerNorm features) and the gemma3 projector (8 × 8 patches pooled to 4 × 4 tokens, RMSNorm, linear);
``--smoke``: the ``tiny_gemma3`` presets. Both sides read the stream's samples, images as their image tokens' blocks
(HF: ``token_type_ids``, which make each image's tokens attend both ways there too). The HF model starts from neva's
initial weights through the export's key table and config (``neva.checkpoint.hf_gemma3``).
"""

from __future__ import annotations

import gc

import torch

from neva.families.gemma3 import gemma3_tokens_per_image
from neva.models.config import NevaConfig, ProjectorConfig, VisionConfig
from neva.models.presets import LLM_PRESETS, VISION_PRESETS, build_config

GEMMA_LLM = dict(
    family="gemma3", qk_norm=True, head_dim=64, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
    sliding_window=128, rope_local_theta=1e4, query_pre_attn_scalar=64,
    layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2,
)  # fmt: skip
GEMMA_VISION = dict(
    kind="siglip", layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh", vision_select_layer=-1, feature_norm=True,
    image_resample="bilinear",
)  # fmt: skip
# transformers 5's module paths of the export's (hub layout) keys: what load_state_dict of a built model takes.
_MODULE_PREFIXES = {
    "language_model.model.": "model.language_model.",
    "vision_tower.vision_model.": "model.vision_tower.",
    "multi_modal_projector.": "model.multi_modal_projector.",
    "language_model.lm_head.": "lm_head.",
}


def model_config(llm: dict, vision: dict, smoke: bool) -> NevaConfig:
    """The benchmark's Gemma 3: ``llm`` / ``vision`` (the CPU shapes) with Gemma 3's traits, or the tiny presets."""
    if smoke:
        llm, vision = dict(LLM_PRESETS["tiny_gemma3"]), dict(VISION_PRESETS["tiny_gemma3"])
    else:
        llm, vision = {**llm, **GEMMA_LLM}, {**vision, **GEMMA_VISION}
    cfg = build_config(llm=llm, vision=None)
    tower = VisionConfig(**vision)
    projector = ProjectorConfig(
        type="gemma3", input_size=tower.hidden_size, output_size=cfg.llm.hidden_size,
        tokens_per_image=gemma3_tokens_per_image(tower.grid), norm_eps=tower.layer_norm_eps,
    )  # fmt: skip
    return NevaConfig(llm=cfg.llm, vision=tower, projector=projector, image_token_id=cfg.image_token_id)


def hf_model(cfg: NevaConfig, neva_state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``Gemma3ForConditionalGeneration`` of ``cfg`` (the export's config) holding ``neva_state``."""
    import transformers

    from neva.checkpoint.hf_gemma3 import _hf_tensors, gemma3_config_dict

    config = transformers.Gemma3Config(**gemma3_config_dict(cfg))
    config._attn_implementation = "sdpa"
    model = transformers.Gemma3ForConditionalGeneration(config)
    state = {}
    for key, tensor in _hf_tensors(neva_state, cfg, None):
        prefix = next(p for p in _MODULE_PREFIXES if key.startswith(p))
        state[_MODULE_PREFIXES[prefix] + key[len(prefix) :]] = tensor
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and cfg.llm.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"weight copy into HF failed: missing {missing}, unexpected {result.unexpected_keys}")
    del state
    gc.collect()
    return model


def hf_part(name: str) -> str:
    """Which part of the trainable policy an HF parameter belongs to."""
    if "multi_modal_projector" in name:
        return "projector"
    if "vision_tower" in name:
        return "vision"
    return "llm"
