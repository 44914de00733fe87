"""A tiny Gemma 3 directory as the hub ships one (transformers' own ``Gemma3ForConditionalGeneration``, random fp32
weights), written in the test: the oracle of the Gemma 3 import, model, generation and export.

Sizes exercise what differs from Llama: 4 decoder layers, sliding (window 5, shorter than the prompts) and global
ones with their own RoPE bases (the global one linearly scaled), an attention scale that is not head_dim's, GQA, and
a SigLIP tower at 28 px / 7 px patches (a 4×4 grid) pooled to 4 tokens per image.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

from tests.hf_oracle import randomise_inits

VOCAB = 300
BOI, IMAGE, EOI = 297, 298, 299  # <start_of_image>, <image_soft_token>, <end_of_image>
TOKENS_PER_IMAGE = 4
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, sliding_window=5, query_pre_attn_scalar=24,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 100_000.0, "factor": 4.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
    max_position_embeddings=512, pad_token_id=0, bos_token_id=2, eos_token_id=1,
)  # fmt: skip
VISION = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=7,
    layer_norm_eps=1e-6, vision_use_head=False,
)  # fmt: skip


def tiny_gemma3(seed: int = 0) -> Gemma3ForConditionalGeneration:
    """A random ``Gemma3ForConditionalGeneration`` (fp32, eval mode); its norms and the projector randomised (HF
    zero-initialises them)."""
    torch.manual_seed(seed)
    cfg = Gemma3Config(
        text_config=Gemma3TextConfig(**TEXT),
        vision_config=SiglipVisionConfig(**VISION),
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        image_token_index=IMAGE,
    )
    model = Gemma3ForConditionalGeneration(cfg).eval()
    randomise_inits(model)
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.2)
    return model


def tiny_gemma3_dir(root: Path, seed: int = 0) -> tuple[Gemma3ForConditionalGeneration, Path]:
    model = tiny_gemma3(seed)
    directory = root / "gemma3-hf"
    model.save_pretrained(directory)
    return model, directory
