"""A tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL directory as the hub ships one (transformers' own model class, random fp32 weights,
a byte-level tokenizer with Qwen's special tokens, the Qwen2-VL processor at a small pixel budget), written in the
test: the oracle of the Qwen-VL import, data path, generation and export."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tests.hf_oracle import randomise_inits

QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PATCH, MERGE = 14, 2
MIN_PIXELS, MAX_PIXELS = 28 * 28, 28 * 28 * 12
# Qwen3-VL: 16-pixel patches (its processor's factor 32) and 0.5 mean / std; the budget the same 1..12 merged tokens.
PATCHES = {"qwen2_vl": PATCH, "qwen2_5_vl": PATCH, "qwen3_vl": 16, "qwen3_vl_moe": 16, "qwen3_5": 16, "qwen3_5_moe": 16}
VOCAB = 416
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
            mrope_section=[2, 3, 3]))  # fmt: skip
VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, hidden_act="quick_gelu"),
    # window 56 px = 2 merge units: the test images hold several windows, some cut short; block 1 attends fully
    "qwen2_5_vl": dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                       window_size=56, fullatt_block_indexes=[1], hidden_act="silu"),
    # 2 DeepStack mergers (blocks 0 and 2): their features join decoder layers 0 and 1 of 3; a 4×4 position table
    "qwen3_vl": dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                     num_position_embeddings=16, deepstack_visual_indexes=[0, 2], hidden_act="gelu_pytorch_tanh"),
}  # fmt: skip
# Qwen3's decoder: q / k norms, explicit head_dim, interleaved M-RoPE (h and w at every third frequency of 8).
TEXT_OF = {"qwen3_vl": dict(TEXT, num_hidden_layers=3, head_dim=16, rope_parameters=dict(
    rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2], mrope_interleaved=True))}  # fmt: skip
# Qwen3-VL-MoE: the same with every block 4 SwiGLU experts of width 24 (gate_up [4, 48, 64]: no square to confuse),
# 2 per token; untied (its text config's own default ties, which the model class does not follow)
TEXT_OF["qwen3_vl_moe"] = dict(TEXT_OF["qwen3_vl"], moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                               tie_word_embeddings=False)  # fmt: skip
VISION["qwen3_vl_moe"] = VISION["qwen3_vl"]
# Qwen3.5: Qwen3-VL's tower without DeepStack; a hybrid decoder: linear attention (2 key heads of 8, 4 value heads of
# 12, 4 conv taps) in layers 0, 1 and 3 (the last: the output-rows path), gated full attention in layer 2 with RoPE
# on a quarter of each 32-wide head (interleaved M-RoPE over 4 frequencies)
VISION["qwen3_5"] = VISION["qwen3_5_moe"] = dict(VISION["qwen3_vl"], deepstack_visual_indexes=[])
TEXT_OF["qwen3_5"] = dict(TEXT, num_hidden_layers=4, head_dim=32, linear_key_head_dim=8, linear_value_head_dim=12,
                          linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
                          layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                          rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1],
                                               mrope_interleaved=True, partial_rotary_factor=0.25))  # fmt: skip
# Qwen3.5-MoE: 4 experts of width 24, 2 per token, a gated shared expert of width 40
TEXT_OF["qwen3_5_moe"] = dict({k: v for k, v in TEXT_OF["qwen3_5"].items() if k != "intermediate_size"},
                              moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
                              num_experts_per_tok=2)  # fmt: skip


def pixel_budget(model_type: str) -> tuple[int, int]:
    """(min_pixels, max_pixels) of the tiny directory's processor: 1 to 12 merged tokens."""
    side = PATCHES[model_type] * MERGE
    return side * side, side * side * 12


def qwen_tokenizer():
    """neva's synthetic byte-level tokenizer with Qwen-VL's special tokens (ids 400 on), no BOS, ``<|im_end|>``
    as EOS."""
    from neva.data.synthetic import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
    tok._tokenizer.post_processor = None  # Qwen's tokenizers add no BOS
    tok.eos_token = "<|im_end|>"
    return tok


def tiny_qwen_vl_dir(root: Path, model_type: str, seed: int = 0) -> Path:
    """Write the directory; returns its path."""
    import transformers

    tok = qwen_tokenizer()
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in zip(
        ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
        ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"))}  # fmt: skip
    config_cls, model_cls = {
        "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
        "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
        "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
        "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
        "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
        "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
    }[model_type]
    vision = dict(VISION[model_type], patch_size=PATCHES[model_type], spatial_merge_size=MERGE, temporal_patch_size=2)
    torch.manual_seed(seed)
    text = TEXT_OF.get(model_type, TEXT)
    config = getattr(transformers, config_cls)(text_config=text, vision_config=vision, **ids)
    model = getattr(transformers, model_cls)(config).eval()
    randomise_inits(model)
    with torch.no_grad():  # unit-scale tower activations: the blocks' share of the features stays visible
        for name, p in model.named_parameters():
            if "visual" in name and name.endswith("weight") and p.dim() > 1:
                p.mul_(8)
    out = root / model_type
    model.save_pretrained(str(out))
    # Its processor's parts (transformers' Qwen2-VL processor class itself needs torchvision for videos)
    image_processor(*pixel_budget(model_type), model_type=model_type).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def image_processor(min_pixels: int, max_pixels: int, model_type: str = "qwen2_vl"):
    from transformers import Qwen2VLImageProcessorPil

    stats = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3) if model_type.startswith("qwen3") else {}
    return Qwen2VLImageProcessorPil(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=PATCHES[model_type], merge_size=MERGE, **stats
    )


def hf_inputs(tokenizer, processor, text: str, images: list) -> dict:
    """What the Qwen2-VL processor gives: each ``<|image_pad|>`` repeated t·h·w / merge² times, the PIL image
    processor's pixels and grids."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    out = {}
    if images:
        out = dict(processor(images=images, return_tensors="pt"))
        pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        counts = iter((out["image_grid_thw"].prod(-1) // MERGE**2).tolist())
        ids = [x for i in ids for x in ([pad] * next(counts) if i == pad else [i])]
    ids = torch.tensor([ids])
    # The processor's token kinds (0 text, 1 image): transformers 5 places M-RoPE by them
    kinds = (ids == tokenizer.convert_tokens_to_ids("<|image_pad|>")).long()
    return {"input_ids": ids, "mm_token_type_ids": kinds, **out}


def write_image(path: Path, size: tuple[int, int], seed: int) -> None:
    """A random RGB image of ``size`` (width, height)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(arr).save(path)


def checkpoint_data_path(ckpt, **settings):
    """An imported checkpoint's model (eval), tokenizer, ``EncoderSettings`` (its recorded template, inline image
    tags, plus ``settings``) and native front end at its recorded pixel budget: training's data path for it."""
    from neva.checkpoint.neva_format import load_metadata, load_model, load_tokenizer
    from neva.data.conversation import get_template
    from neva.data.dataset import EncoderSettings
    from neva.data.front_ends import front_end_for
    from neva.data.tokens import image_token_for, tokenizer_image_token_id

    model = load_model(ckpt).eval()
    tokenizer, meta = load_tokenizer(ckpt), load_metadata(ckpt)
    template = meta["conv_template"]
    encoder = EncoderSettings(
        tokenizer=tokenizer,
        template=get_template(template, tokenizer),
        image_token_id=tokenizer_image_token_id(tokenizer, image_token_for(template)),
        num_image_tokens=0,
        max_length=512,
        image_token_placement="inline",
        **settings,
    )
    front_end = front_end_for(model.cfg.vision, model.cfg, "square", meta["min_pixels"], meta["max_pixels"])
    return model, tokenizer, encoder, front_end
