"""The rehearsal's step inputs: synthetic samples of the planner's shape, collated by the run's own collator.

A sample holds ``text_tokens`` text tokens and one visual input, laid out by the data side's own rules so that the
rehearsed step sees what a real sample of that shape gives the model (the same keys, shapes and positions):

* a fixed-size image: one tile, ``num_image_tokens`` positions;
* an AnyRes image of ``image_size`` (default the largest pinpoint, ``neva.models.anyres.largest_pinpoint``, the size
  the planner assumes): its tiles through the tower and its positions after unpad, pool and newline from
  ``neva.models.anyres.feature_index``, with the feature index (and, pooled, weights) ``neva.data.anyres`` stores;
* a native-resolution tower's image of ``image_size`` (the planner's: already resized within the budget; default the
  largest the data's ``max_pixels`` lets through, ``neva.data.qwen_images.budget_size``): its patches, grid and the
  sample's M-RoPE positions, as ``neva.data.front_ends.NativeImages`` gives them;
* a video of ``num_frames`` frames (``plan.num_frames``): that many tower inputs, ``NevaConfig.video_tokens`` positions
  carrying the video token, as ``neva.data.video`` lays them out.

Pixel values are zeros (uint8, as the loader gives them): the step's memory depends on shapes only.

A preference stage (``stage=dpo``) steps on pairs: ``micro_batch_size`` pairs of that sample, chosen and rejected,
through the stage's own collator (``neva.data.preference.PairCollator``: ``2 · micro_batch_size`` rows), with zero
reference log-probs when the run precomputes them (no reference forward in its step).
"""

from __future__ import annotations

from typing import Any

import torch

from neva.config import TrainConfig
from neva.constants import IGNORE_INDEX
from neva.data.anyres import anyres_sample_fields
from neva.data.collate import Collator
from neva.data.config import DataConfig
from neva.data.micro_batch import MicroBatch
from neva.data.qwen_images import QwenImageSpec, budget_size
from neva.families import part
from neva.models.anyres import feature_index, largest_pinpoint
from neva.models.config import NevaConfig
from neva.models.mrope import mrope_positions
from neva.parallel.layout import Layout
from neva.stages import stage_spec


def _visual_fields(
    ncfg: NevaConfig, image_size: tuple[int, int] | None, num_frames: int | None, data: DataConfig | None = None
) -> dict[str, Any]:
    """A sample's visual keys, its visual positions' count (``"tokens"``) and the id they carry (``"token_id"``)."""
    if ncfg.vision is not None and ncfg.vision.spec.patch_grid and not num_frames:
        return _native_fields(ncfg, image_size, data or DataConfig())
    if ncfg.vision is None:
        empty = torch.zeros((0, 3, 0, 0), dtype=torch.uint8)
        return {"tokens": 0, "token_id": 0, "pixel_values": empty, "image_positions": torch.zeros(0, dtype=torch.long)}
    side = ncfg.vision.image_size

    def pixels(n: int) -> torch.Tensor:
        return torch.zeros((n, 3, side, side), dtype=torch.uint8)

    if num_frames:
        if ncfg.video is None:
            raise ValueError("plan.num_frames needs a video model (model.mm_cfg.mm_spatial_pool_stride)")
        tokens = ncfg.video_tokens(num_frames)
        return {
            "tokens": tokens,
            "token_id": ncfg.video_token,
            "pixel_values": pixels(0),
            "image_count": 0,
            "video_pixel_values": pixels(num_frames),
            "video_frames": torch.tensor([num_frames]),
            "video_positions": torch.arange(1, 1 + tokens),
            "image_positions": torch.zeros(0, dtype=torch.long),
        }
    if ncfg.anyres is None:
        # A family that tiles each image by its own rule (InternVL): the planner's tiles of the image, each a tower
        # input of the fixed count (the front end's ``image_count`` is its tiles)
        tiled = ncfg.vision.spec.tiles
        tiles = 1 if tiled is None else part(tiled)(image_size, side)
        tokens, extra = tiles * ncfg.num_image_tokens, {"pixel_values": pixels(tiles), "image_count": tiles}
    else:
        size = image_size or largest_pinpoint(ncfg.anyres)
        layout = feature_index(ncfg.anyres, ncfg.num_image_tokens, side, size)
        tokens = layout.tokens
        extra = {**anyres_sample_fields([layout], ncfg.num_image_tokens), "pixel_values": pixels(layout.tiles)}
    return {"tokens": tokens, "token_id": ncfg.image_token_id, "image_count": 1,
            "image_positions": torch.arange(1, 1 + tokens), **extra}  # fmt: skip


def _native_fields(ncfg: NevaConfig, image_size: tuple[int, int] | None, data: DataConfig) -> dict[str, Any]:
    """A native tower's image: zero patches ``[P, patch_dim]`` of the grid of ``image_size`` (resized by the data
    side's rule, which keeps a size the planner resized), its grid; the M-RoPE positions follow from the ids. A family
    that sizes its images by its own rule (``TowerSpec.native_sizes``: Pixtral's) gives its positions and where among
    them its features go (its rows' breaks skipped); its decoder reads no M-RoPE."""
    sizes = ncfg.vision.spec.native_sizes
    if sizes is not None:
        h, w, tokens, offsets = part(sizes)(ncfg.vision, image_size)
        grid = torch.tensor([[1, h // ncfg.vision.patch_size, w // ncfg.vision.patch_size]])
        return {
            "tokens": tokens,
            "token_id": ncfg.image_token_id,
            "image_count": 1,
            "pixel_values": torch.zeros((int(grid.prod()), ncfg.vision.patch_dim), dtype=torch.uint8),
            "image_grid": grid,
            "image_positions": 1 + offsets,
        }
    spec = QwenImageSpec.for_tower(ncfg.vision, data.min_pixels, data.max_pixels)
    h, w = budget_size(spec) if image_size is None else image_size
    if h % spec.factor or w % spec.factor:
        raise ValueError(f"native image {h}x{w}: sides must be multiples of {spec.factor} (the planner's resized size)")
    grid = torch.tensor([[1, h // spec.patch_size, w // spec.patch_size]])
    patches = int(grid.prod())
    return {
        "tokens": patches // spec.merge_size**2,
        "token_id": ncfg.image_token_id,
        "image_count": 1,
        "pixel_values": torch.zeros((patches, ncfg.vision.patch_dim), dtype=torch.uint8),
        "image_grid": grid,
    }


def synthetic_sample(
    ncfg: NevaConfig,
    text_tokens: int,
    learned_fraction: float,
    image_size: tuple[int, int] | None = None,
    num_frames: int | None = None,
    data: DataConfig | None = None,
) -> dict[str, Any]:
    """One sample as the dataset gives it: BOS, the visual positions, then text; the last ``learned_fraction`` of the
    ``text_tokens`` (BOS included) learned. ``data``: the run's data keys (a native tower's pixel budget)."""
    visual = _visual_fields(ncfg, image_size, num_frames, data)
    n_vis, token_id = visual.pop("tokens"), visual.pop("token_id")
    learned = max(1, round(text_tokens * learned_fraction))
    ids = torch.full((n_vis + text_tokens,), 5, dtype=torch.long)
    ids[0] = 1
    ids[1 : 1 + n_vis] = token_id
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[-learned:] = ids[-learned:]
    if "image_grid" in visual and "image_positions" not in visual:  # a Qwen tower: its positions, M-RoPE's
        visual["image_positions"] = torch.arange(1, 1 + n_vis)
        visual["position_ids"], _ = mrope_positions(
            ids,
            visual["image_grid"],
            spatial_merge_size=ncfg.vision.spatial_merge_size,
            image_token_id=token_id,
            video_token_id=-1,
            family=ncfg.vision.kind,
        )
    return {"input_ids": ids, "labels": labels, **visual}


def synthetic_micro_batches(
    cfg: TrainConfig,
    ncfg: NevaConfig,
    layout: Layout,
    text_tokens: int,
    learned_fraction: float,
    image_size: tuple[int, int] | None = None,
    num_frames: int | None = None,
) -> list[MicroBatch]:
    """One step's micro-batches through the run's own collator: ``micro_batch_size`` copies of ``synthetic_sample``
    per micro-batch (host tensors, as the loader gives them)."""
    data = cfg.model.data
    sample = synthetic_sample(ncfg, text_tokens, learned_fraction, image_size, num_frames, data)
    # No ``model.data.seq_length``: the model's ``max_seq_len``, as the data module decides. An M-RoPE decoder reads
    # three position axes (``NevaDataModule``'s collator).
    axes = 3 if ncfg.llm.mrope_section is not None else 1
    seq_length = data.seq_length or ncfg.llm.max_seq_len
    stage = stage_spec(cfg.stage)
    if stage.rehearsal_batches is not None:  # the stage's own (a preference pair's two sequences)
        return part(stage.rehearsal_batches)(cfg, sample, seq_length, layout)
    collate = Collator(0, seq_length, data.pad_to_multiple_of, data.packing, axes)
    return [
        collate([{**sample, "id": m * layout.micro_batch_size + i} for i in range(layout.micro_batch_size)])
        for m in range(layout.grad_accum)
    ]
