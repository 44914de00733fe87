"""Tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL models (transformers' own classes, fp32, CPU) and prompts laid out
as their processors lay them out: the numerical oracle of M-RoPE (neva/models/mrope.py, rope.py)."""

from __future__ import annotations

import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from neva.models.config import LLMConfig

VOCAB, VISION_START, VISION_END, IMAGE, VIDEO = 99, 95, 96, 97, 98
MERGE, TOKENS_PER_SECOND = 2, 4
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
TEXT.update(num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False)
# Qwen2-VL's sectioned layout over head_dim 16 (8 frequencies: t 2, h 3, w 3); Qwen3-VL's interleaved one over
# head_dim 32 (16 frequencies; h at 1, 4, .., 13, w at 2, 5, .., 14, t at the other 6), as [24, 20, 20] of 64.
SECTIONED = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])
INTERLEAVED = dict(rope_type="default", rope_theta=5000.0, mrope_section=[6, 5, 5], mrope_interleaved=True)
IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START)
IDS.update(vision_end_token_id=VISION_END, tie_word_embeddings=False)

FAMILIES = {
    "qwen2_vl": (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        dict(TEXT, rope_parameters=SECTIONED),
        dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, spatial_merge_size=MERGE),
    ),
    "qwen2_5_vl": (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        dict(TEXT, rope_parameters=SECTIONED),
        dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
    ),
    "qwen3_vl": (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        dict(TEXT, head_dim=32, rope_parameters=INTERLEAVED),
        dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
    ),
}


def tiny_qwen_vl(family: str, seed: int = 0):
    """A random ``<Family>ForConditionalGeneration`` in eval mode, its norms and biases randomised (HF inits them to
    1 and 0) and its q / k projections scaled up: sharp attention, so that positions change the logits visibly."""
    config_cls, model_cls, text, vision = FAMILIES[family]
    vision = dict(vision, spatial_merge_size=MERGE)
    if family == "qwen2_5_vl":
        vision["tokens_per_second"] = TOKENS_PER_SECOND
    torch.manual_seed(seed)
    model = model_cls(config_cls(text_config=text, vision_config=vision, **IDS)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)
    return model


def llm_config(family: str, **extra) -> LLMConfig:
    """neva's decoder settings of the family's text model."""
    text = FAMILIES[family][2]
    rope = text["rope_parameters"]
    return LLMConfig(
        vocab_size=VOCAB,
        hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"],
        num_layers=text["num_hidden_layers"],
        num_heads=text["num_attention_heads"],
        num_kv_heads=text["num_key_value_heads"],
        head_dim=text.get("head_dim"),
        rope_theta=rope["rope_theta"],
        rms_norm_eps=text["rms_norm_eps"],
        family="qwen2",
        qkv_bias=family != "qwen3_vl",
        qk_norm=family == "qwen3_vl",
        mrope_section=rope["mrope_section"],
        mrope_interleaved=rope.get("mrope_interleaved", False),
        **extra,
    )


def text(n: int, seed: int) -> list[int]:
    return torch.randint(0, VISION_START, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def item(token: int, grid: tuple[int, int, int]) -> list[int]:
    """One image / video (or Qwen3-VL video frame) between vision start and end, as the processors expand it."""
    t, h, w = grid
    return [VISION_START] + [token] * (t * (h // MERGE) * (w // MERGE)) + [VISION_END]


def qwen3_video(grid: tuple[int, int, int], seed: int) -> list[int]:
    """Qwen3-VL's video: per frame a timestamp (two text tokens here) then the frame's tokens."""
    t, h, w = grid
    return [tok for f in range(t) for tok in text(2, seed + f) + item(VIDEO, (1, h, w))]
