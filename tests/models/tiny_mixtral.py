"""Tiny random HF Mixtral models (LLaVA with a Mixtral text config, and the standalone LLM): the MoE oracle."""

from __future__ import annotations

import torch
from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, MixtralConfig

from tests.hf_oracle import TEXT_KW, VISION_KW, randomise_inits

MIXTRAL_KW = dict(TEXT_KW, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0)


def tiny_mixtral_llava(seed: int = 0, **text_kw) -> LlavaForConditionalGeneration:
    """A random LlavaForConditionalGeneration over a Mixtral decoder (fp32, eval mode); image token = last id."""
    torch.manual_seed(seed)
    text = {**MIXTRAL_KW, **text_kw}
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION_KW),
        text_config=MixtralConfig(**text),
        image_token_index=text["vocab_size"] - 1,
        image_seq_length=(VISION_KW["image_size"] // VISION_KW["patch_size"]) ** 2,
    )
    model = LlavaForConditionalGeneration(cfg).eval()
    randomise_inits(model)
    return model
