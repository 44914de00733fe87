"""CPU mode ``--family internvl``: neva's training step on InternVL 3 against transformers'
``InternVLForConditionalGeneration`` with a plain AdamW loop, on the same model, samples and tiles.

The model: the CPU benchmark's decoder as Qwen2 (q/k/v biases, tied embeddings) behind InternViT at the benchmark's
tower shapes (112 px tiles in 14 px patches: 64 patches, 16 decoder positions per tile after the pixel shuffle) and
InternVL's pixel shuffle + LayerNorm + MLP projector; ``--smoke``: the ``tiny_internvl`` tower and ``tiny_qwen2``. A
visual sample holds one image of a random tile grid (columns × rows ≤ 6, the thumbnail added where there is more than
one tile, as InternVL's tiling gives: 1 to 7 tower inputs), its tiles uint8 (neva normalises in the tower; the HF side
gets them normalised by the same rule with the tower's ImageNet statistics, as its processor gives them). The HF model
starts from neva's initial weights through the export's key table and config (``neva.checkpoint.hf_internvl``).
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import torch

from bench.data import BOS_ID, PAD_ID
from neva.constants import IGNORE_INDEX
from neva.models.config import NevaConfig
from neva.models.presets import LLM_PRESETS, VISION_PRESETS, build_config

INTERN_VISION = dict(
    kind="internvl", image_size=112, patch_size=14, hidden_size=256, intermediate_size=1024, num_layers=4,
    num_heads=4, hidden_act="gelu",
)  # fmt: skip
MAX_GRID_TILES = 6  # columns × rows of a sample's image


def model_config(llm: dict, smoke: bool) -> NevaConfig:
    """The benchmark's InternVL: ``llm`` (the CPU shapes as Qwen2) behind InternViT and the pixel shuffle projector."""
    if smoke:
        llm = dict(LLM_PRESETS["tiny_qwen2"])
    vision = VISION_PRESETS["tiny_internvl"] if smoke else INTERN_VISION
    return build_config(llm=llm, vision=vision, projector_type="mlp_pixel_shuffle")


def tiled_sample(cfg: NevaConfig, base: dict[str, Any], index: int, seed: int) -> dict[str, Any]:
    """``base`` (the stream's sample: its text, labels and whether it has an image) with a tiled image instead of a
    fixed one: a random grid's tiles (and the thumbnail), their positions as neva's dataset gives them."""
    v = cfg.vision
    n_fixed = int(base["image_positions"].numel())
    text, labels = base["input_ids"][1 + n_fixed :], base["labels"][1 + n_fixed :]
    rng = np.random.default_rng([seed, index, 2])
    tiles = 0
    if n_fixed:
        sides = range(1, MAX_GRID_TILES + 1)
        grids = [(c, r) for c in sides for r in sides if c * r <= MAX_GRID_TILES]
        columns, rows = grids[rng.integers(len(grids))]
        tiles = 1 if columns * rows == 1 else columns * rows + 1
    pixels = torch.from_numpy(rng.integers(0, 256, size=(tiles, 3, v.image_size, v.image_size), dtype=np.uint8))
    n_img = tiles * cfg.num_image_tokens
    ids = torch.cat([torch.tensor([BOS_ID]), torch.full((n_img,), cfg.image_token_id), text])
    full_labels = torch.cat([torch.full((1 + n_img,), IGNORE_INDEX), labels])
    return {
        "id": index, "input_ids": ids, "labels": full_labels, "pixel_values": pixels, "image_count": tiles,
        "image_positions": torch.arange(1, 1 + n_img),
    }  # fmt: skip


def collate_hf_tiled(cfg: NevaConfig, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """What an HF user feeds ``InternVLForConditionalGeneration``: right-padded ids, labels and mask, every image's
    tiles normalised (``pixel_values`` ``[Σ tiles, 3, s, s]`` float, as the processor gives)."""
    from neva.models.vision import normalize_pixels

    longest = max(s["input_ids"].numel() for s in samples)
    input_ids = torch.full((len(samples), longest), PAD_ID, dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for r, s in enumerate(samples):
        n = s["input_ids"].numel()
        input_ids[r, :n], labels[r, :n], attention_mask[r, :n] = s["input_ids"], s["labels"], 1
    out = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
    tiles = [s["pixel_values"] for s in samples if s["pixel_values"].shape[0]]
    if tiles:
        out["pixel_values"] = normalize_pixels(torch.cat(tiles), cfg.vision.image_mean, cfg.vision.image_std)
    return out


def hf_model(cfg: NevaConfig, neva_state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``InternVLForConditionalGeneration`` of ``cfg`` (the export's config) holding ``neva_state``."""
    import transformers

    from neva.checkpoint.hf_internvl import _hf_tensors, internvl_config_dict

    config = transformers.InternVLConfig(**internvl_config_dict(cfg))
    config._attn_implementation = "sdpa"
    model = transformers.InternVLForConditionalGeneration(config)
    state = {k.replace("language_model.model.", "language_model."): t for k, t in _hf_tensors(neva_state, cfg, None)}
    state = {("model." + k if not k.startswith("language_model.lm_head") else "lm_head.weight"): t
             for k, t in state.items()}  # fmt: skip
    result = model.load_state_dict(state, strict=False)
    # A tied LM head is the embedding (not a tensor of its own in the export).
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and cfg.llm.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"weight copy into HF failed: missing {missing}, unexpected {result.unexpected_keys}")
    del state
    gc.collect()
    return model
