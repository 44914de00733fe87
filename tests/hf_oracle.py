"""Tiny random HF models (the numerical oracle) and helpers to load their weights into neva models."""

from __future__ import annotations

import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig

from neva.checkpoint.hf_config import neva_config_from_llava
from neva.checkpoint.hf_keys import detect_prefixes, hf_key_to_neva
from neva.checkpoint.hf_moe import canonical_tensors, expert_groups
from neva.models.neva import NevaModel

VISION_KW = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=28, patch_size=7
)
# A SigLIP tower on an odd patch grid (5×5: mlp_downsample pads it), the attention-pooling head kept as hub
# checkpoints have it (LLaVA never runs it; import drops it).
SIGLIP_KW = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=35, patch_size=7
)
TEXT_KW = dict(
    vocab_size=99,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
)


def randomise_inits(model: torch.nn.Module) -> None:
    """HF inits norms to 1, biases to 0 (and LLaVA-NeXT's ``image_newline`` to one draw): randomise them so that the
    key mapping of each is really tested."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "image_newline" in name:
                p.add_(torch.randn_like(p) * 0.1)


def tiny_llava(
    seed: int = 0, text_kw: dict | None = None, tower: str = "clip", text_cls: type = LlamaConfig, **llava_kw
) -> LlavaForConditionalGeneration:
    """A random LlavaForConditionalGeneration (fp32, eval mode); image token = last id of the vocab. ``text_cls``:
    the decoder family's HF config class (LlamaConfig, MistralConfig, Qwen2Config).

    ``tower="siglip"``: a SigLIP vision config (``SIGLIP_KW``) fed in full (``vision_feature_select_strategy=full``,
    as llava-hf's SigLIP checkpoints do)."""
    torch.manual_seed(seed)
    text = {**TEXT_KW, **(text_kw or {})}
    if tower == "siglip":
        vision, vision_kw = SiglipVisionConfig(**SIGLIP_KW), SIGLIP_KW
        llava_kw.setdefault("vision_feature_select_strategy", "full")
    else:
        vision, vision_kw = CLIPVisionConfig(**VISION_KW), VISION_KW
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text_cls(**text),
        image_token_index=text["vocab_size"] - 1,
        image_seq_length=(vision_kw["image_size"] // vision_kw["patch_size"]) ** 2,
        **llava_kw,
    )
    model = LlavaForConditionalGeneration(cfg).eval()
    randomise_inits(model)
    return model


def neva_from_hf(hf_model: LlavaForConditionalGeneration) -> NevaModel:
    """A neva model holding exactly the HF model's weights."""
    cfg = neva_config_from_llava(hf_model.config.to_dict())
    model = NevaModel(cfg).eval()
    sd = hf_model.state_dict()
    sd = dict(canonical_tensors(sd.items(), expert_groups(sd)))  # Mixtral experts: one tensor per layer
    prefixes = detect_prefixes(sd.keys())
    ours = {}
    for key, value in sd.items():
        neva = hf_key_to_neva(key, prefixes)
        if neva is not None:
            ours[neva] = value
    missing, unexpected = model.load_state_dict(ours, strict=True)
    assert not missing and not unexpected
    return model


def tiny_llava_next(seed: int = 0, text_kw: dict | None = None, tower: str = "clip", pinpoints=None):
    """A random LlavaNextForConditionalGeneration (fp32, eval) on the towers of ``tiny_llava``; pinpoints default to
    1x2, 2x1, 2x2, 3x1, 1x3 tiles."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    torch.manual_seed(seed)
    text = {**TEXT_KW, **(text_kw or {})}
    vision_kw = SIGLIP_KW if tower == "siglip" else VISION_KW
    vision = SiglipVisionConfig(**SIGLIP_KW) if tower == "siglip" else CLIPVisionConfig(**VISION_KW)
    s = vision_kw["image_size"]
    cfg = LlavaNextConfig(
        vision_config=vision,
        text_config=LlamaConfig(**text),
        image_token_index=text["vocab_size"] - 1,
        image_grid_pinpoints=pinpoints or [[s, 2 * s], [2 * s, s], [2 * s, 2 * s], [3 * s, s], [s, 3 * s]],
        vision_feature_select_strategy="full" if tower == "siglip" else "default",
    )
    model = LlavaNextForConditionalGeneration(cfg).eval()
    randomise_inits(model)
    return model
