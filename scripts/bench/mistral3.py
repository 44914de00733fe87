"""CPU mode ``--family mistral3``: neva's training step on Mistral 3 against transformers'
``Mistral3ForConditionalGeneration`` with a plain AdamW loop, on the same model, samples and images.

The model: the CPU benchmark's decoder as Mistral behind Pixtral at the benchmark's tower shapes (14 px patches, each
image at its own size) and Mistral 3's projector (RMSNorm, 2×2 patch merger, Linear-GELU-Linear); ``--smoke``: the
``tiny_pixtral`` tower and the tiny decoder as Mistral. A visual sample holds one image of a random size (2 to 8
merged tokens a side, as ``bench.qwen_vl``'s native images), its patches uint8 in merge-block order (neva normalises
in the tower) and its text as ``PixtralProcessor`` writes it: rows of image tokens, each closed by a break token, the
last by an end token. The HF side gets the same images normalised by the same rule and padded to the batch's largest
with their ``image_sizes``, as its processor gives them. The HF model starts from neva's initial weights through the
export's key table and config (``neva.checkpoint.hf_mistral3``).
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import numpy as np
import torch

from bench.data import BOS_ID, PAD_ID
from neva.constants import IGNORE_INDEX
from neva.models.config import NevaConfig
from neva.models.presets import LLM_PRESETS, VISION_PRESETS, build_config

PIXTRAL_VISION = dict(
    kind="pixtral", image_size=224, patch_size=14, hidden_size=256, intermediate_size=1024, num_layers=4,
    num_heads=4, hidden_act="silu", temporal_patch_size=1,
)  # fmt: skip
MERGED_SIDES = (2, 8)  # an image's sides in merged tokens (patch × merge pixels each)


def model_config(llm: dict, smoke: bool) -> NevaConfig:
    """The benchmark's Mistral 3: ``llm`` (the CPU shapes as Mistral) behind Pixtral and Mistral 3's projector; the
    break and end tokens just below the image token."""
    llm = dict(LLM_PRESETS["tiny"] if smoke else llm, family="mistral")
    vision = VISION_PRESETS["tiny_pixtral"] if smoke else PIXTRAL_VISION
    cfg = build_config(llm=llm, vision=vision, projector_type="pixtral_merger")
    return dataclasses.replace(
        cfg, image_break_token_id=cfg.image_token_id - 1, image_end_token_id=cfg.image_token_id - 2
    )


def pixtral_sample(cfg: NevaConfig, base: dict[str, Any], index: int, seed: int) -> dict[str, Any]:
    """``base`` (the stream's sample: its text, labels and whether it has an image) with a Pixtral image instead of a
    fixed one: a random size, its patches and grid, its span of rows; image positions as neva's dataset gives them."""
    v, merge = cfg.vision, cfg.vision.spatial_merge_size
    n_fixed = int(base["image_positions"].numel())
    text, labels = base["input_ids"][1 + n_fixed :], base["labels"][1 + n_fixed :]
    rng = np.random.default_rng([seed, index, 3])
    rows = columns = 0
    if n_fixed:
        rows, columns = (int(x) for x in rng.integers(MERGED_SIDES[0], MERGED_SIDES[1] + 1, size=2))
    grid = torch.tensor([[1, rows * merge, columns * merge]]) if n_fixed else torch.zeros(0, 3, dtype=torch.long)
    patches = torch.from_numpy(rng.integers(0, 256, size=(rows * columns * merge**2, v.patch_dim), dtype=np.uint8))
    span = torch.full((rows, columns + 1), cfg.image_token_id)
    span[:, -1] = cfg.image_break_token_id
    span = span.flatten()
    if span.numel():
        span[-1] = cfg.image_end_token_id
    offsets = (torch.arange(rows)[:, None] * (columns + 1) + torch.arange(columns)).flatten()
    ids = torch.cat([torch.tensor([BOS_ID]), span, text])
    full_labels = torch.cat([torch.full((1 + span.numel(),), IGNORE_INDEX), labels])
    return {
        "id": index, "input_ids": ids, "labels": full_labels, "pixel_values": patches, "image_grid": grid,
        "image_count": int(n_fixed > 0), "image_positions": 1 + offsets,
    }  # fmt: skip


def _image(patches: torch.Tensor, grid: list[int], v: Any) -> torch.Tensor:
    """Merge-block-order patches of one image → its pixels ``[3, h·P, w·P]``."""
    _, h, w = grid
    m, p = v.spatial_merge_size, v.patch_size
    x = patches.view(h // m, w // m, m, m, v.num_channels, p, p)
    return x.permute(4, 0, 2, 5, 1, 3, 6).reshape(v.num_channels, h * p, w * p)


def collate_hf_pixtral(cfg: NevaConfig, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """What an HF user feeds ``Mistral3ForConditionalGeneration``: right-padded ids, labels and mask, every image
    normalised and zero-padded to the batch's largest (``pixel_values`` ``[N, 3, H, W]``) with its ``image_sizes``."""
    from neva.models.native_vision import normalize_patches

    v = cfg.vision
    longest = max(s["input_ids"].numel() for s in samples)
    input_ids = torch.full((len(samples), longest), PAD_ID, dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for r, s in enumerate(samples):
        n = s["input_ids"].numel()
        input_ids[r, :n], labels[r, :n], attention_mask[r, :n] = s["input_ids"], s["labels"], 1
    out = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
    images = [
        _image(normalize_patches(s["pixel_values"], v, torch.float32), g, v)
        for s in samples
        for g in s["image_grid"].tolist()
    ]
    if images:
        height, width = max(i.shape[1] for i in images), max(i.shape[2] for i in images)
        pixels = torch.zeros(len(images), v.num_channels, height, width)
        for i, image in enumerate(images):
            pixels[i, :, : image.shape[1], : image.shape[2]] = image
        out["pixel_values"] = pixels
        out["image_sizes"] = torch.tensor([list(i.shape[1:]) for i in images])
    return out


def hf_model(cfg: NevaConfig, neva_state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``Mistral3ForConditionalGeneration`` of ``cfg`` (the export's config) holding ``neva_state``."""
    import transformers

    from neva.checkpoint.hf_mistral3 import _hf_tensors, mistral3_config_dict

    config = transformers.Mistral3Config(**mistral3_config_dict(cfg))
    config._attn_implementation = "sdpa"
    model = transformers.Mistral3ForConditionalGeneration(config)
    state = {k.replace("language_model.model.", "language_model."): t for k, t in _hf_tensors(neva_state, cfg, None)}
    state = {("model." + k if not k.startswith("language_model.lm_head") else "lm_head.weight"): t
             for k, t in state.items()}  # fmt: skip
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and cfg.llm.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"weight copy into HF failed: missing {missing}, unexpected {result.unexpected_keys}")
    del state
    gc.collect()
    return model
