"""CPU mode ``--family qwen2_5_vl`` / ``qwen3_5``: neva's native-resolution training step against transformers'
``Qwen2_5_VLForConditionalGeneration`` / ``Qwen3_5ForConditionalGeneration`` with a plain AdamW loop, on the same
model, samples and images.

Qwen3.5: the CPU benchmark's width (384) and depth (8) as the hybrid decoder — Gated DeltaNet in layers 0-2 and 4-6
(3 query / key heads of 64 serving 6 value heads of 64, 4 conv taps), gated attention in layers 3 and 7 (6 heads of
64, 2 KV heads, RoPE on 16 channels of each, interleaved M-RoPE), (1 + w) norms, untied — behind Qwen3-VL's tower
(16 px patches merged 2 × 2, 4 blocks of width 256, a learned 8 × 8 position table, no DeepStack); ``--smoke``: the
``tiny_qwen3_5`` presets.

The model: the CPU benchmark's decoder as Qwen2 (q/k/v biases, tied embeddings, M-RoPE sections of its 64-wide heads)
behind a Qwen2.5-VL tower (14 px patches merged 2 × 2, 56 px windows but in the last block, SwiGLU, RMSNorm) and its
patch merger; ``--smoke``: the ``tiny_qwen2_5_vl`` presets. A visual sample holds one image of a random size (sides
between 2 and 8 merged tokens, so images differ in patches as real ones do), its patches in the HF processor's
order (uint8: neva normalises in the tower, the HF side gets the same patches normalised by the same rule, as its
processor gives them), its grid and, for neva, its M-RoPE positions (``neva.models.mrope``, as the data path adds
them); HF finds its own from ``image_grid_thw`` and ``mm_token_type_ids``. The HF model starts from neva's initial
weights through the export's key table (``neva.checkpoint.hf_qwen_vl``) and config (``qwen_vl_config_dict``).
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

QWEN_VISION = dict(
    kind="qwen2_5_vl", image_size=112, patch_size=14, hidden_size=256, intermediate_size=512, num_layers=4,
    num_heads=4, hidden_act="silu", window_size=56, fullatt_block_indexes=[3],
)  # fmt: skip
QWEN3_VISION = dict(
    kind="qwen3_vl", image_size=128, patch_size=16, hidden_size=256, intermediate_size=512, num_layers=4,
    num_heads=4, hidden_act="gelu_pytorch_tanh", num_position_embeddings=64,
)  # fmt: skip
QWEN3_5 = dict(
    family="qwen3_5", num_kv_heads=2, head_dim=64, rope_theta=1e6, rms_norm_eps=1e-6, qk_norm=True,
    attention_output_gate=True, rotary_percent=0.25, layernorm_zero_centered_gamma=True, mrope_interleaved=True,
    linear_attention=dict(
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, conv_kernel_dim=4, key_head_dim=64,
        value_head_dim=64, num_key_heads=3, num_value_heads=6,
    ),
)  # fmt: skip
MROPE = {"cpu": [8, 12, 12], "smoke": [4, 6, 6]}  # temporal / height / width halves of 64- and 32-wide heads
# Qwen3.5: of the 8 rotary frequencies of a quarter of 64 channels (cpu), of 32 (smoke: 4 frequencies)
MROPE_3_5 = {"cpu": [4, 2, 2], "smoke": [2, 1, 1]}
MERGED_SIDES = (2, 8)  # an image's sides in merged tokens (factor = patch × merge pixels each)


def model_config(llm: dict, smoke: bool, family: str = "qwen2_5_vl") -> NevaConfig:
    """The benchmark's Qwen2.5-VL: ``llm`` (the CPU shapes as Qwen2) with M-RoPE, behind the tower and its merger;
    or its Qwen3.5 (module docstring)."""
    if family == "qwen3_5":
        llm = LLM_PRESETS["tiny_qwen3_5"] if smoke else {**llm, **QWEN3_5}
        llm = {**llm, "mrope_section": MROPE_3_5["smoke" if smoke else "cpu"], "mrope_interleaved": True}
        vision = VISION_PRESETS["tiny_qwen3_5"] if smoke else QWEN3_VISION
        return build_config(llm=llm, vision=vision, projector_type="qwen3_vl_merger")
    if smoke:
        llm = {**LLM_PRESETS["tiny_qwen2"], "family": "qwen2"}
    llm = {**llm, "mrope_section": MROPE["smoke" if smoke else "cpu"]}
    vision = VISION_PRESETS["tiny_qwen2_5_vl"] if smoke else QWEN_VISION
    return build_config(llm=llm, vision=vision, projector_type="qwen2_5_vl_merger")


def native_sample(cfg: NevaConfig, base: dict[str, Any], index: int, seed: int) -> dict[str, Any]:
    """``base`` (the stream's sample: its text, labels and whether it has an image) with a native image instead of a
    fixed one: a random size, its patches, grid and M-RoPE positions; image positions as neva's dataset gives them."""
    from neva.models.mrope import mrope_positions

    v = cfg.vision
    n_fixed = int(base["image_positions"].numel())
    text = base["input_ids"][1 + n_fixed :]
    labels = base["labels"][1 + n_fixed :]
    rng = np.random.default_rng([seed, index, 1])
    if n_fixed:
        gh, gw = (int(x) * v.spatial_merge_size for x in rng.integers(MERGED_SIDES[0], MERGED_SIDES[1] + 1, size=2))
        grid = torch.tensor([[1, gh, gw]])
        patches = torch.from_numpy(rng.integers(0, 256, size=(gh * gw, v.patch_dim), dtype=np.uint8))
        n_img = gh * gw // v.spatial_merge_size**2
    else:
        grid, patches, n_img = torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, v.patch_dim, dtype=torch.uint8), 0
    ids = torch.cat([torch.tensor([BOS_ID]), torch.full((n_img,), cfg.image_token_id), text])
    full_labels = torch.cat([torch.full((1 + n_img,), IGNORE_INDEX), labels])
    positions, _ = mrope_positions(
        ids, grid, spatial_merge_size=v.spatial_merge_size, image_token_id=cfg.image_token_id, video_token_id=-1,
        family=v.kind,
    )  # fmt: skip
    return {
        "id": index, "input_ids": ids, "labels": full_labels, "pixel_values": patches, "image_grid": grid,
        "image_count": int(n_img > 0), "image_positions": torch.arange(1, 1 + n_img), "position_ids": positions,
    }  # fmt: skip


def collate_hf_native(cfg: NevaConfig, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """What an HF user feeds ``Qwen2_5_VLForConditionalGeneration``: right-padded ids, labels and mask, every image's
    patches normalised (``pixel_values`` ``[Σ patches, C·T·P·P]`` float, as the processor gives), ``image_grid_thw``
    and ``mm_token_type_ids`` (1 at image positions)."""
    from neva.models.native_vision import normalize_patches

    longest = max(s["input_ids"].numel() for s in samples)
    input_ids = torch.full((len(samples), longest), PAD_ID, dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for r, s in enumerate(samples):
        n = s["input_ids"].numel()
        input_ids[r, :n], labels[r, :n], attention_mask[r, :n] = s["input_ids"], s["labels"], 1
    out = {
        "input_ids": input_ids, "labels": labels, "attention_mask": attention_mask,
        "mm_token_type_ids": (input_ids == cfg.image_token_id).int(),
    }  # fmt: skip
    with_images = [s for s in samples if s["pixel_values"].shape[0]]
    if with_images:
        pixels = torch.cat([s["pixel_values"] for s in with_images])
        out["pixel_values"] = normalize_patches(pixels, cfg.vision, torch.float32)
        out["image_grid_thw"] = torch.cat([s["image_grid"] for s in with_images])
    return out


def hf_model(cfg: NevaConfig, neva_state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The family's transformers class (``Qwen2_5_VLForConditionalGeneration``, ``Qwen3_5ForConditionalGeneration``)
    of ``cfg`` (the export's config) holding ``neva_state``."""
    import transformers

    from neva.checkpoint.hf_linear_attention import fuse_tensors
    from neva.checkpoint.hf_moe import stacked_tensors
    from neva.checkpoint.hf_qwen_vl import _BY_TOWER, _hf_tensors, qwen_vl_config_dict

    row = _BY_TOWER[(cfg.vision.kind, cfg.llm.family)]
    config = getattr(transformers, row.config_class)(**qwen_vl_config_dict(cfg))
    config._attn_implementation = "sdpa"
    model = getattr(transformers, row.model_class)(config)
    state = dict(fuse_tensors(stacked_tensors(_hf_tensors(neva_state, cfg, None))))
    result = model.load_state_dict(state, strict=False)
    # A tied LM head is the embedding (not a tensor of its own in the export).
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and cfg.llm.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"weight copy into HF failed: missing {missing}, unexpected {result.unexpected_keys}")
    del state
    gc.collect()
    return model


def hf_part(name: str) -> str:
    """Which part of the trainable policy an HF parameter belongs to."""
    if "visual.merger" in name:
        return "projector"
    if "visual." in name:
        return "vision"
    return "llm"
