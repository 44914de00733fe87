"""LLaVA-NeXT AnyRes: the grid geometry and the feature layout of a tiled image, one rule for data and model.

An AnyRes image is cut into ``1 + rows × cols`` square tiles of the tower's ``image_size`` (the overview first, then
the grid row-major; ``neva.data.anyres``). The tower and projector turn every tile into a ``t × t`` feature grid
(``t`` = the patch grid, or ``ceil(grid / 2)`` after ``mlp_downsample``). How those features are laid out in the
decoder's sequence (``mm_patch_merge_type``) is expressed here as an index map over the flattened tile features of
one image: ``feature_index`` is computed on the host, from the image's size alone, by the dataset (its length *is*
the image's token count, so packing, truncation and the skip rules see real lengths) and the model gathers with it
(``AnyResMerge``), so the two cannot disagree and the step needs no host-device sync.

The layouts are transformers' ``LlavaNextModel.pack_image_features`` / ``unpad_image`` and LLaVA-NeXT's
``prepare_inputs_labels_for_multimodal``:

* ``flat``: every tile's features in tile order (overview first).
* ``spatial``: the overview, then the grid's features as one ``rows·t × cols·t`` image, row-major.
* ``spatial_unpad``: the overview, then that big grid with the rows (or columns) that only saw the resize-and-pad
  padding removed, each remaining row followed by the learned ``image_newline`` (transformers' only layout).
  With LLaVA-OneVision's ``anyres_max_N`` that unpadded grid is first resized bilinearly when it holds more than about
  N tiles' features (``pool_grid``): the index then names four rows per position, blended with host-computed weights
  (``Layout.weight``), so the count is still the host's and the model still only gathers.

A fixed-size image (one tile; ``size`` None below) is its tile's features, plus one newline under ``spatial_unpad``
(LLaVA-NeXT's rule for a single-tile image).

Sizes are ``(height, width)`` throughout, as in transformers (LLaVA-NeXT's own code passes ``(width, height)`` and
its pinpoints as ``(width, height)``; the range form ``(1x1),...,(3x3)`` is symmetric, so it means the same).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from neva.typed import ConfigError

MERGE_TYPES = ("flat", "spatial", "spatial_unpad")
NEWLINE = -1
"""``feature_index`` entry meaning the learned ``image_newline`` row."""


@dataclass
class AnyResConfig:
    """The model side of AnyRes (LLaVA-NeXT's ``image_grid_pinpoints`` / ``mm_patch_merge_type``).

    ``grid_pinpoints``: candidate resolutions ``[height, width]`` in pixels, each a multiple of the tower's
    ``image_size``. ``max_num_patches``: LLaVA-OneVision's ``image_aspect_ratio: anyres_max_N`` (None: plain
    ``anyres``): an image whose unpadded grid holds more than about N tiles' features is pooled down to N
    (``pool_grid``); LLaVA-OneVision pools only under the ``unpad`` layouts, and so does neva. ``unpad_truncate``:
    the unpadded extent as LLaVA-NeXT's own ``unpad_image`` computes it (``int`` of the scaled side) instead of
    transformers' (``int(round(side, 7))``); the two differ for about 0.02 % of image sizes, where float error puts
    the scaled side just below a whole number (``unpadded_bounds``). Set by the import of LLaVA-NeXT's original
    checkpoints (``neva.checkpoint.llava_original``).
    """

    grid_pinpoints: list[list[int]] = field(default_factory=lambda: [[336, 672], [672, 336], [672, 672]])
    patch_merge_type: str = "spatial_unpad"
    max_num_patches: int | None = None
    unpad_truncate: bool = False

    def __post_init__(self) -> None:
        if self.patch_merge_type not in MERGE_TYPES:
            raise ValueError(f"mm_patch_merge_type must be one of {MERGE_TYPES}, got {self.patch_merge_type!r}")
        if not self.grid_pinpoints or any(len(p) != 2 or min(p) <= 0 for p in self.grid_pinpoints):
            raise ValueError(f"image_grid_pinpoints must be [height, width] pairs, got {self.grid_pinpoints!r}")
        if self.max_num_patches is not None and (self.max_num_patches < 1 or not self.has_newline):
            raise ValueError(
                f"image_aspect_ratio=anyres_max_{self.max_num_patches} needs N >= 1 and mm_patch_merge_type "
                f"spatial_unpad (LLaVA-OneVision pools only there), got {self.patch_merge_type!r}"
            )

    @property
    def has_newline(self) -> bool:
        """LLaVA-NeXT creates ``image_newline`` only for the ``unpad`` layouts."""
        return "unpad" in self.patch_merge_type

    def check_tile(self, image_size: int) -> None:
        """Every pinpoint must be a whole number of tiles (transformers tiles with a step of ``image_size``)."""
        bad = [p for p in self.grid_pinpoints if p[0] % image_size or p[1] % image_size]
        if bad:
            raise ValueError(f"image_grid_pinpoints {bad} are not multiples of the tower's image_size {image_size}")


def anyres_on(image_aspect_ratio: str, grid_pinpoints: object) -> bool:
    """Whether a run tiles its images (LLaVA-NeXT AnyRes): the data's ``image_aspect_ratio`` (``anyres`` /
    ``anyres_max_N``) and the model's ``image_grid_pinpoints`` turn it on together, so the architecture and the data
    side ask this one rule and cannot disagree.

    Raises:
        ConfigError: one is given without the other; names both keys and values.
    """
    on = image_aspect_ratio.startswith("anyres")
    if on != (grid_pinpoints is not None):
        raise ConfigError(
            "model.data.image_aspect_ratio=anyres (or anyres_max_N) and model.mm_cfg.image_grid_pinpoints go "
            f"together: image_aspect_ratio={image_aspect_ratio!r}, image_grid_pinpoints={grid_pinpoints!r}"
        )
    return on


def parse_aspect_ratio(aspect_ratio: str) -> int | None:
    """``max_num_patches`` of an ``image_aspect_ratio``: N of LLaVA-OneVision's ``anyres_max_N``, else None."""
    match = re.fullmatch(r"anyres_max_(\d+)", aspect_ratio)
    return int(match.group(1)) if match else None


def parse_grid_pinpoints(spec: str | Sequence[Sequence[int]], image_size: int) -> list[list[int]]:
    """``image_grid_pinpoints`` as a list of ``[height, width]`` pixels.

    Takes the list, or LLaVA's range form ``"(1x1),...,(3x3)"`` (every grid from the first to the last, in tiles of
    ``image_size``: LLaVA-NeXT's ``process_anyres_image``).
    """
    if isinstance(spec, str):
        matches = re.findall(r"\((\d+)x(\d+)\)", spec)
        if "x" not in spec or not matches:
            raise ValueError(f"image_grid_pinpoints {spec!r}: expected a list or the form '(1x1),...,(3x3)'")
        (a0, b0), (a1, b1) = (tuple(map(int, m)) for m in (matches[0], matches[-1]))
        return [[i * image_size, j * image_size] for i in range(a0, a1 + 1) for j in range(b0, b1 + 1)]
    return [[int(h), int(w)] for h, w in spec]


def select_best_resolution(size: tuple[int, int], pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The pinpoint that keeps most of the image's pixels after an aspect-preserving downscale, then wastes least
    (transformers' ``select_best_resolution``; ties keep the first). ``size`` and result are ``(height, width)``."""
    h, w = size
    best, best_effective, best_wasted = None, 0, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        effective = min(int(w * scale) * int(h * scale), w * h)
        wasted = ph * pw - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (ph, pw), effective, wasted
    return best


def grid_shape(size: tuple[int, int], pinpoints: Sequence[Sequence[int]], image_size: int) -> tuple[int, int]:
    """``(rows, cols)`` of tiles for an image of ``size`` (height, width)."""
    ph, pw = select_best_resolution(size, pinpoints)
    return ph // image_size, pw // image_size


def largest_pinpoint(cfg: AnyResConfig) -> tuple[int, int]:
    """``(height, width)`` of the pinpoint with the most pixels: an image of that size is AnyRes's worst case (the
    most tiles; the most positions unless pooled), the size the planner and the rehearsal assume by default."""
    h, w = max(cfg.grid_pinpoints, key=lambda p: p[0] * p[1])
    return int(h), int(w)


def unpadded_bounds(
    size: tuple[int, int], grid_hw: tuple[int, int], truncate: bool = False
) -> tuple[int, int, int, int]:
    """``(top, bottom, left, right)`` of the feature grid ``grid_hw`` that saw the image, not the padding
    (transformers' ``unpad_image``: the same rounding, the same ``// 2`` on both sides; ``truncate``: LLaVA-NeXT's
    own ``unpad_image``, which takes ``int`` of the scaled side without rounding it first)."""
    oh, ow = size
    ch, cw = grid_hw

    def whole(side: float) -> int:
        return int(side) if truncate else int(round(side, 7))

    if ow / oh > cw / ch:
        pad = (ch - whole(oh * (cw / ow))) // 2
        return pad, ch - pad, 0, cw
    pad = (cw - whole(ow * (ch / oh))) // 2
    return 0, ch, pad, cw - pad


class Layout(NamedTuple):
    """One image's (or several images') layout over its tiles' flattened features.

    ``index``: ``[T]`` the feature row of every decoder position, NEWLINE for ``image_newline``; or, pooled
    (``anyres_max_N``), ``[T, 4]`` the rows each position blends with ``weight`` ``[T, 4]`` (bilinear).
    ``tiles``: how many tiles the image has (the next image's rows start after them).
    """

    index: torch.Tensor
    tiles: int
    weight: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.index.shape[0]


def _bilinear_taps(size_in: int, size_out: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(i0, i1, w1)`` per output index: ``torch.nn.functional.interpolate``'s ``bilinear`` rule
    (``align_corners=False``, the scale ``in / out`` in float32, sources below 0 clamped, the upper tap clamped
    to the edge); the output is ``(1 - w1)·x[i0] + w1·x[i1]``."""
    scale = torch.tensor(size_in, dtype=torch.float32) / size_out
    src = (scale * (torch.arange(size_out, dtype=torch.float32) + 0.5) - 0.5).clamp(min=0)
    i0 = src.long()
    i1 = torch.clamp(i0 + 1, max=size_in - 1)
    return i0, i1, src - i0


def pool_grid(big: torch.Tensor, max_num_patches: int, side: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """LLaVA-OneVision's ``anyres_max_N`` on an unpadded feature grid ``big`` ``[h, w]`` (feature rows): None if it
    is kept (``ratio = sqrt(h·w / (N·side²)) <= 1.1``), else ``(index [h', w', 4], weight [h', w', 4])`` of the
    bilinear resize to ``(int(h // ratio), int(w // ratio))`` (LLaVA-NeXT's ``prepare_inputs_labels_for_multimodal``,
    transformers' ``LlavaOnevisionModel.pack_image_features``)."""
    h, w = big.shape
    ratio = math.sqrt(h * w / (max_num_patches * side**2))
    if ratio <= 1.1:
        return None
    y0, y1, wy = _bilinear_taps(h, int(h // ratio))
    x0, x1, wx = _bilinear_taps(w, int(w // ratio))
    index = torch.stack([big[y0][:, x0], big[y0][:, x1], big[y1][:, x0], big[y1][:, x1]], dim=-1)  # [h', w', 4]
    wy, wx = wy[:, None], wx[None, :]
    weight = torch.stack([(1 - wy) * (1 - wx), (1 - wy) * wx, wy * (1 - wx), wy * wx], dim=-1)
    return index, weight


def _as_taps(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain index ``[T]`` as ``[T, 4]`` taps: the row itself with weight 1, three zero-weight copies."""
    weight = torch.zeros(index.shape[0], 4)
    weight[:, 0] = 1
    return index[:, None].expand(-1, 4), weight


def feature_index(cfg: AnyResConfig, per_tile: int, image_size: int, size: tuple[int, int] | None) -> Layout:
    """One image's layout (``Layout``) over its own tiles.

    Args:
        per_tile: features per tile after the projector (``NevaConfig.num_image_tokens``; ``t²`` for the spatial
            layouts).
        image_size: the tower's input side (the tile size in pixels).
        size: the image's ``(height, width)``; None for a fixed-size (single-tile) image.
    """
    base = torch.arange(per_tile)
    if size is None:
        parts = [base, torch.tensor([NEWLINE])] if cfg.has_newline else [base]
        return Layout(torch.cat(parts), 1)
    rows, cols = grid_shape(size, cfg.grid_pinpoints, image_size)
    tiles = 1 + rows * cols
    if cfg.patch_merge_type == "flat":
        return Layout(torch.arange(tiles * per_tile), tiles)
    side = math.isqrt(per_tile)
    y = torch.arange(rows * side)[:, None]
    x = torch.arange(cols * side)[None, :]
    big = (1 + (y // side) * cols + x // side) * per_tile + (y % side) * side + (x % side)
    if not cfg.has_newline:
        return Layout(torch.cat([base, big.flatten()]), tiles)
    top, bottom, left, right = unpadded_bounds(size, (rows * side, cols * side), cfg.unpad_truncate)
    big = big[top:bottom, left:right]
    pooled = pool_grid(big, cfg.max_num_patches, side) if cfg.max_num_patches is not None else None
    if pooled is None:
        big = torch.cat([big, torch.full((big.shape[0], 1), NEWLINE)], dim=1)
        return Layout(torch.cat([base, big.flatten()]), tiles)
    index, weight = pooled
    newline_index, newline_weight = _as_taps(torch.full((index.shape[0],), NEWLINE))
    index = torch.cat([index, newline_index[:, None]], dim=1).flatten(0, 1)
    weight = torch.cat([weight, newline_weight[:, None]], dim=1).flatten(0, 1)
    base_index, base_weight = _as_taps(base)
    return Layout(torch.cat([base_index, index]), tiles, torch.cat([base_weight, weight]))


def image_token_count(cfg: AnyResConfig, per_tile: int, image_size: int, size: tuple[int, int] | None) -> int:
    """Decoder positions of one image: the length of its ``feature_index`` (the one rule)."""
    return feature_index(cfg, per_tile, image_size, size).tokens


class AnyResMerge(nn.Module):
    """The learned ``image_newline`` and the gather that lays tile features out (``feature_index``)."""

    def __init__(self, cfg: AnyResConfig, hidden_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.image_newline = nn.Parameter(torch.empty(hidden_size)) if cfg.has_newline else None

    def forward(
        self, feats_NTD: torch.Tensor, index_M: torch.Tensor, weight_MK: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Tile features ``[N, T, D]`` → ``[M, D]``: row ``index_M[i]`` of the flattened features, NEWLINE (-1) the
        newline, appended as the last row so that -1 indexes it; pooled (``index_MK`` ``[M, 4]`` with
        ``weight_MK``), the weighted sum of the rows each position blends."""
        rows = feats_NTD.flatten(0, 1)
        if self.image_newline is not None:
            rows = torch.cat([rows, self.image_newline.to(rows.dtype)[None]])
        picked = rows[index_M.to(rows.device)]
        if weight_MK is None:
            return picked
        return (picked * weight_MK.to(picked.device, picked.dtype)[..., None]).sum(dim=1)

    @torch.no_grad()
    def init_weights(self) -> None:
        # LLaVA-NeXT: randn(hidden) * 1/sqrt(hidden).
        if self.image_newline is not None:
            self.image_newline.normal_(0.0, self.image_newline.shape[0] ** -0.5)


def concat_layouts(layouts: Sequence[Layout], per_tile: int) -> Layout:
    """Layouts of consecutive images (or samples) → one layout over their tiles concatenated; if any is pooled, all
    become ``[T, 4]`` taps."""
    if not layouts:
        return Layout(torch.zeros(0, dtype=torch.long), 0)
    pooled = any(lay.weight is not None for lay in layouts)
    indices, weights, first = [], [], 0
    for lay in layouts:
        index, weight = lay.index, lay.weight
        if pooled and weight is None:
            index, weight = _as_taps(index)
        indices.append(torch.where(index >= 0, index + first * per_tile, index))
        weights.append(weight)
        first += lay.tiles
    return Layout(torch.cat(indices), first, torch.cat(weights) if pooled else None)


def batch_feature_index(
    cfg: AnyResConfig, per_tile: int, image_size: int, sizes: Sequence[tuple[int, int] | None]
) -> tuple[Layout, list[int]]:
    """Several images' layouts over their tiles concatenated in order: ``(layout, tokens per image)``."""
    layouts = [feature_index(cfg, per_tile, image_size, size) for size in sizes]
    return concat_layouts(layouts, per_tile), [lay.tokens for lay in layouts]
