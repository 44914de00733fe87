"""A tiny Mistral 3 directory as the hub ships one (transformers' ``Mistral3ForConditionalGeneration``, random fp32
weights, a byte-level tokenizer with Mistral 3's special tokens, Pixtral's image processor), written in the test: the
oracle of the Mistral 3 import, data path, generation and export.

4-px patches merged 2×2, a longest edge of 64 px: an image is at most 8 × 8 merged tokens (16 × 16 patches), so
images of several sizes stay small for the decoder. The decoder is Mistral's (no sliding window, as Mistral Small
3.1's), its LM head untied (pipeline stages split it from the embedding); the tower's MLP is gated SiLU (the hub
checkpoints' ``hidden_act``), its projector biased in one variant and not in the other (HF's default)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.hf_oracle import randomise_inits

SPECIALS = ["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
PATCH, MERGE, EDGE = 4, 2, 64
MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
VOCAB = 416
TEXT = dict(model_type="mistral", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6})  # fmt: skip
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
              image_size=EDGE, patch_size=PATCH, hidden_act="silu")  # fmt: skip
VARIANTS = {"mistral3": dict(bias=False), "mistral3_bias": dict(bias=True)}


def mistral3_tokenizer():
    """neva's synthetic byte-level tokenizer (BOS ``<s>``, EOS ``</s>``) with Mistral 3's special tokens (ids 400
    on)."""
    from neva.data.synthetic import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tok


def image_processor():
    """Pixtral's image side, PIL backend (``PixtralProcessor`` calls it with patch × merge as its patch size)."""
    from transformers import PixtralImageProcessorPil

    return PixtralImageProcessorPil(
        size={"longest_edge": EDGE}, patch_size={"height": PATCH, "width": PATCH}, image_mean=MEAN, image_std=STD
    )


def tiny_mistral3_dir(root: Path, variant: str, seed: int = 0) -> Path:
    """Write the directory; returns its path."""
    import transformers

    tok = mistral3_tokenizer()
    torch.manual_seed(seed)
    config = transformers.Mistral3Config(
        text_config=TEXT, vision_config=VISION, image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=MERGE, multimodal_projector_bias=VARIANTS[variant]["bias"], tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    randomise_inits(model)
    with torch.no_grad():  # unit-scale tower activations: the blocks' share of the features stays visible
        for name, p in model.named_parameters():
            if "vision_tower" in name and name.endswith("weight") and p.dim() > 1:
                p.mul_(8)
            elif name.endswith("ln_pre.weight"):  # not a "norm" by name: randomised here
                p.add_(torch.randn_like(p) * 0.1)
    out = root / variant
    model.save_pretrained(str(out))
    image_processor().save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def hf_inputs(tokenizer, text: str, images: list) -> dict:
    """What ``PixtralProcessor`` gives (it needs torchvision, absent here, so by its rules): each ``[IMG]`` of
    ``text`` becomes the image's rows of ``[IMG]`` (one per merged token) each closed by ``[IMG_BREAK]``, the last
    by ``[IMG_END]``; the pixels and ``image_sizes`` the image processor's at patch × merge."""
    out = {}
    if images:
        out = dict(image_processor()(images=images, patch_size={"height": PATCH * MERGE, "width": PATCH * MERGE},
                                     return_tensors="pt"))  # fmt: skip
        pieces = text.split("[IMG]")
        blocks = []
        for h, w in out["image_sizes"].tolist():
            rows = [["[IMG]"] * (w // (PATCH * MERGE)) + ["[IMG_BREAK]"] for _ in range(h // (PATCH * MERGE))]
            flat = [t for row in rows for t in row]
            flat[-1] = "[IMG_END]"
            blocks.append("".join(flat))
        text = pieces[0] + "".join(b + p for b, p in zip(blocks, pieces[1:]))
    return {"input_ids": torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]]), **out}
