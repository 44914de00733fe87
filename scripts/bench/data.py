"""A deterministic stream of variable-length multimodal samples, and the HF-style padded collation.

Both sides of the CPU benchmark consume exactly these samples in exactly this order, so the only differences
between them are how each batches, computes and steps. A sample is what ``neva.data`` datasets yield:
``{"id", "input_ids", "labels", "pixel_values"}`` with image tokens already expanded (as the llava-hf processor
expands them too). Lengths are long-tailed like LLaVA-Instruct's, which is what makes padding expensive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from neva.constants import IGNORE_INDEX

BOS_ID = 1
PAD_ID = 0


@dataclass(frozen=True)
class StreamSpec:
    """Shape of the sample stream.

    Attributes:
        vocab_size: token ids are drawn from ``[4, vocab_size - 1)`` (the last id is the image token).
        image_token_id: id every image position carries.
        num_image_tokens: LLM positions per image.
        image_size: pixels per side.
        text_median: median text length (tokens, excluding image positions).
        text_sigma: log-normal spread of text lengths (0 = every sample ``text_median`` long).
        text_min / text_max: clip of text lengths.
        text_only_fraction: samples without an image (LLaVA-1.5's mix has about 6%).
        learned_fraction: share of text tokens that are assistant replies (learned); the rest is prompt.
        seed: stream seed.
        grid_pinpoints: AnyRes (``--anyres``): the model's pinpoints; each image then gets a random size between
            half and twice the grid's largest side, its tiles and its own positions (``neva.models.anyres``).
        num_frames / video_tokens / video_token_id: video (``--video``; 0 frames = none): a visual sample is a video
            with probability ``video_fraction``, ``num_frames`` frames taking ``video_tokens`` positions of
            ``video_token_id`` (the placements of an image; text ids stay below both special ids).
    """

    vocab_size: int
    image_token_id: int
    num_image_tokens: int
    image_size: int
    text_median: float = 128.0
    text_sigma: float = 0.75
    text_min: int = 16
    text_max: int = 896
    text_only_fraction: float = 0.1
    learned_fraction: float = 0.6
    seed: int = 0
    grid_pinpoints: tuple[tuple[int, int], ...] | None = None
    num_frames: int = 0
    video_tokens: int = 0
    video_token_id: int | None = None
    video_fraction: float = 0.4


def make_sample(spec: StreamSpec, index: int) -> dict[str, Any]:
    """Sample ``index`` of the stream (a pure function of ``spec`` and ``index``)."""
    rng = np.random.default_rng([spec.seed, index])
    if spec.text_sigma > 0:
        n_text = int(
            np.clip(np.exp(rng.normal(np.log(spec.text_median), spec.text_sigma)), spec.text_min, spec.text_max)
        )
    else:
        n_text = int(spec.text_median)
    has_image = rng.random() >= spec.text_only_fraction
    n_learned = max(1, round(n_text * spec.learned_fraction))
    n_prompt = max(0, n_text - n_learned - 1)  # BOS counts as prompt
    first_special = min(spec.image_token_id, spec.video_token_id or spec.image_token_id)
    text = torch.from_numpy(rng.integers(4, first_special, size=n_prompt + n_learned)).long()
    # Drawn after the text (and only with video on), so the streams without video stay what they were.
    has_video = has_image and spec.num_frames > 0 and rng.random() < spec.video_fraction
    if has_video:
        return _video_sample(spec, index, text[:n_prompt], text[n_prompt:])
    n_img = spec.num_image_tokens if has_image else 0
    tiles, anyres = 1, {}
    if spec.grid_pinpoints is not None and has_image:
        from neva.models.anyres import AnyResConfig, feature_index

        top = max(max(p) for p in spec.grid_pinpoints)
        h, w = (int(x) for x in rng.integers(top // 2, 2 * top + 1, size=2))
        lay = feature_index(AnyResConfig([list(p) for p in spec.grid_pinpoints]), spec.num_image_tokens,
                            spec.image_size, (h, w))  # fmt: skip
        n_img, tiles = lay.tokens, lay.tiles
        anyres = {"image_feature_index": lay.index, "tile_tokens": spec.num_image_tokens, "image_count": 1,
                  "image_size_hw": (h, w)}  # fmt: skip
    input_ids = torch.cat(
        [torch.tensor([BOS_ID]), torch.full((n_img,), spec.image_token_id), text[:n_prompt], text[n_prompt:]]
    )
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[1 + n_img + n_prompt :] = input_ids[1 + n_img + n_prompt :]
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + index)
    pixels = torch.randn((tiles if has_image else 0, 3, spec.image_size, spec.image_size), generator=gen)
    image_positions = torch.arange(1, 1 + n_img)  # as neva's dataset gives them (the collator offsets them)
    return {
        "id": index,
        "input_ids": input_ids,
        "image_positions": image_positions,
        "labels": labels,
        "pixel_values": pixels,
        **anyres,
    }


def _video_sample(spec: StreamSpec, index: int, prompt: torch.Tensor, reply: torch.Tensor) -> dict[str, Any]:
    """A video sample as ``neva.data``'s dataset yields it (``neva.data.video.video_sample_fields``): BOS, the video's
    positions, prompt, reply; no image."""
    n = spec.video_tokens
    input_ids = torch.cat([torch.tensor([BOS_ID]), torch.full((n,), spec.video_token_id), prompt, reply])
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[1 + n + prompt.numel() :] = reply
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + index)
    return {
        "id": index,
        "input_ids": input_ids,
        "image_positions": torch.arange(0),
        "labels": labels,
        "pixel_values": torch.zeros(0, 3, spec.image_size, spec.image_size),
        "video_positions": torch.arange(1, 1 + n),
        "video_pixel_values": torch.randn((spec.num_frames, 3, spec.image_size, spec.image_size), generator=gen),
        "video_frames": torch.tensor([spec.num_frames]),
    }


def make_batches(spec: StreamSpec, batch_size: int, num_batches: int) -> list[list[dict[str, Any]]]:
    """``num_batches`` consecutive global batches of ``batch_size`` samples."""
    return [[make_sample(spec, b * batch_size + i) for i in range(batch_size)] for b in range(num_batches)]


def collate_hf(samples: list[dict[str, Any]], pad_id: int = PAD_ID) -> dict[str, torch.Tensor]:
    """What an HF user feeds ``LlavaForConditionalGeneration`` (``LlavaNext``: tiles and ``image_sizes``,
    ``LlavaNextVideo``: ``pixel_values_videos`` too): right-padded to the batch's longest sample.

    This is LLaVA's own ``DataCollatorForSupervisedDataset`` (pad to the longest, ``attention_mask``, labels
    ``IGNORE_INDEX`` on padding).
    """
    longest = max(s["input_ids"].numel() for s in samples)
    input_ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for r, s in enumerate(samples):
        n = s["input_ids"].numel()
        input_ids[r, :n] = s["input_ids"]
        labels[r, :n] = s["labels"]
        attention_mask[r, :n] = 1
    pixels = [s["pixel_values"] for s in samples if s["pixel_values"].shape[0]]
    out = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
    if pixels and "image_size_hw" in next(s for s in samples if s["pixel_values"].shape[0]):
        # LlavaNext: [images, most tiles, C, H, W], zero-padded as its image processor pads, and image_sizes
        most = max(p.shape[0] for p in pixels)
        out["pixel_values"] = torch.stack(
            [torch.cat([p, p.new_zeros(most - p.shape[0], *p.shape[1:])]) for p in pixels]
        )
        out["image_sizes"] = torch.tensor([s["image_size_hw"] for s in samples if s["pixel_values"].shape[0]])
    elif pixels:
        out["pixel_values"] = torch.cat(pixels)
    videos = [s["video_pixel_values"] for s in samples if "video_positions" in s]
    if videos:  # LlavaNextVideo: [videos, frames, C, H, W] (every video of the stream has the same frames)
        out["pixel_values_videos"] = torch.stack(videos)
    return out


def real_tokens(samples: list[dict[str, Any]]) -> int:
    """Tokens of the samples themselves (no padding)."""
    return sum(s["input_ids"].numel() for s in samples)
