"""A tiny InternVL 3 / 3.5 directory as the hub ships one (transformers' ``InternVLForConditionalGeneration``, random
fp32 weights, a byte-level tokenizer with InternVL's special tokens, the tiling image processor), written in the test:
the oracle of the InternVL import, data path, generation and export.

Tiles of 28 px with 7-px patches: a 4×4 patch grid, 4 tokens per tile after the pixel shuffle, so an image of up to
12 tiles and its thumbnail stays small for the decoder. Two variants: ``internvl3`` (InternViT-300M's blocks:
LayerNorm, biased q / k / v, a Qwen2 decoder, untied head) and ``internvl3_qk`` (InternViT-6B's: RMSNorm, q / k
norms, no q / k / v bias, a Qwen3 decoder, tied head as the top-level default)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.hf_oracle import randomise_inits

SPECIALS = ["<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
TILE, PATCH = 28, 7
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
VOCAB = 416
TEXT = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)  # fmt: skip
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=TILE,
              patch_size=PATCH, layer_norm_eps=1e-6)  # fmt: skip
VARIANTS = {
    "internvl3": dict(text=TEXT, vision=dict(VISION, attention_bias=True), tie=False),
    "internvl3_qk": dict(
        text=dict(TEXT, model_type="qwen3", head_dim=16),
        vision=dict(VISION, norm_type="rms_norm", use_qk_norm=True, attention_bias=False),
        tie=True,
    ),
}


def internvl_tokenizer():
    """neva's synthetic byte-level tokenizer with InternVL's special tokens (ids 400 on), no BOS, ``<|im_end|>``
    as EOS."""
    from neva.data.synthetic import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok._tokenizer.post_processor = None  # Qwen's tokenizers add no BOS
    tok.eos_token = "<|im_end|>"
    return tok


def image_processor():
    """The processor's image side as ``InternVLProcessor`` runs it (``crop_to_patches`` on), PIL backend."""
    from transformers import GotOcr2ImageProcessorPil

    return GotOcr2ImageProcessorPil(
        size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=1, max_patches=12,
        image_mean=MEAN, image_std=STD,
    )  # fmt: skip


def tiny_internvl_dir(root: Path, variant: str, seed: int = 0) -> Path:
    """Write the directory; returns its path."""
    import transformers

    tok = internvl_tokenizer()
    spec = VARIANTS[variant]
    torch.manual_seed(seed)
    config = transformers.InternVLConfig(
        text_config=spec["text"], vision_config=spec["vision"], image_token_id=tok.convert_tokens_to_ids(
            "<IMG_CONTEXT>"), image_seq_length=(TILE // PATCH // 2) ** 2, tie_word_embeddings=spec["tie"],
    )  # fmt: skip
    model = transformers.InternVLForConditionalGeneration(config).eval()
    randomise_inits(model)
    with torch.no_grad():  # HF's zero class token / positions and constant layer scales: random, so each maps
        for name, p in model.named_parameters():
            if name.endswith(("cls_token", "position_embeddings", "lambda_1", "lambda_2")):
                p.copy_(torch.randn_like(p) * 0.5)
            elif "vision_tower" in name and name.endswith("weight") and p.dim() > 1:
                p.mul_(8)  # unit-scale tower activations: the blocks' share of the features stays visible
    out = root / variant
    model.save_pretrained(str(out))
    image_processor().save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def hf_inputs(tokenizer, text: str, images: list) -> dict:
    """What ``InternVLProcessor`` gives (it needs torchvision, absent here, so by its rules): each
    ``<IMG_CONTEXT>`` of ``text`` becomes ``<img>`` + ``<IMG_CONTEXT>`` × 4 × the image's tiles + ``</img>``, the
    pixels the image processor's (``crop_to_patches``)."""
    out = {}
    if images:
        out = dict(image_processor()(images=images, return_tensors="pt"))
        tiles = iter(out.pop("num_patches").tolist())
        ctx = "<IMG_CONTEXT>"
        pieces = text.split(ctx)
        text = pieces[0] + "".join(f"<img>{ctx * 4 * next(tiles)}</img>" + p for p in pieces[1:])
    return {"input_ids": torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]]), **out}
