"""The numerical oracle of M-RoPE (neva/models/mrope.py, rope.py): the tests' one tiny Qwen2-VL / Qwen2.5-VL /
Qwen3-VL (tests/fixtures/tiny_qwen_vl.py, transformers' own classes, fp32, CPU) with sharpened attention, neva's
decoder settings of its text model, and prompts laid out as the processors lay them out."""

from __future__ import annotations

import torch

from neva.models.config import LLMConfig
from tests.fixtures.tiny_qwen_vl import (
    IM_START,
    IMAGE_PAD,
    MERGE,
    TEXT,
    TEXT_OF,
    VIDEO_PAD,
    VISION,
    VISION_END,
    VISION_START,
    VOCAB,
    tiny_qwen_vl_model,
)

IMAGE, VIDEO = IMAGE_PAD, VIDEO_PAD
TOKENS_PER_SECOND = VISION["qwen2_5_vl"]["tokens_per_second"]


def tiny_qwen_vl(family: str, seed: int = 0):
    """The fixture's random model, its q / k projections scaled up: sharp attention, so that positions change the
    logits visibly."""
    model = tiny_qwen_vl_model(family, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)
    return model


def text_config(family: str) -> dict:
    """The family's text model settings (transformers' names)."""
    return TEXT_OF.get(family, TEXT)


def llm_config(family: str, **extra) -> LLMConfig:
    """neva's decoder settings of the family's text model."""
    text = text_config(family)
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
    """``n`` random text tokens: byte-level ones, below Qwen's special tokens."""
    return torch.randint(0, IM_START, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def item(token: int, grid: tuple[int, int, int]) -> list[int]:
    """One image / video (or Qwen3-VL video frame) between vision start and end, as the processors expand it."""
    t, h, w = grid
    return [VISION_START] + [token] * (t * (h // MERGE) * (w // MERGE)) + [VISION_END]


def qwen3_video(grid: tuple[int, int, int], seed: int) -> list[int]:
    """Qwen3-VL's video: per frame a timestamp (two text tokens here) then the frame's tokens."""
    t, h, w = grid
    return [tok for f in range(t) for tok in text(2, seed + f) + item(VIDEO, (1, h, w))]
