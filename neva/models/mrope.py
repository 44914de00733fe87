"""M-RoPE positions of one sample (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``[3, S]`` (t, h, w) and its rope delta.

Text tokens count along all three axes alike; a visual item's tokens (one per merged ``spatial_merge_size²`` patch
block, in t, h, w order) take ``start + (t, h, w)`` of their place in the item's merged grid, where ``start`` is the
position after the text before it; the text after it starts at ``start + max(h, w)`` (merged). This is transformers'
``get_rope_index`` (5.25) for one row without padding; the families differ only in videos (their ``TowerSpec.video``).

transformers <= 5.2 and Qwen's own code start the text after an item one past the item's largest position instead:
the same for images and Qwen3-VL's frames (t = 1), later for a Qwen2-VL / Qwen2.5-VL video whose temporal positions
outrun its merged max(h, w). neva follows 5.25 (the installed oracle).

Here, in the lowest layer, so that the data layer (a sample's positions, found on the host) and generation (a
prompt's) share it. The decoder's side is ``neva.models.rope.rope_cos_sin``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from neva.errors import InputError
from neva.families import TOWERS

HF_TOKENS_PER_SECOND = 4  # Qwen2.5-VL: transformers' Qwen2_5_VLVisionConfig default


def _grid_positions(start: int, grid: Sequence[int], merge: int, interval: torch.Tensor | None) -> torch.Tensor:
    """``[3, t·h·w]`` positions of one item's merged grid placed at ``start``."""
    t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
    tt = torch.arange(t) if interval is None else (torch.arange(t) * interval).long()  # HF: float32, truncated
    tt, hh, ww = torch.meshgrid(tt, torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_positions(
    input_ids: torch.Tensor,
    image_grids: torch.Tensor | None = None,
    video_grids: torch.Tensor | None = None,
    *,
    spatial_merge_size: int,
    image_token_id: int,
    video_token_id: int,
    family: str = "qwen2_vl",
    second_per_grid_ts: Sequence[float] | torch.Tensor | None = None,
    tokens_per_second: float | None = None,
) -> tuple[torch.Tensor, int]:
    """Positions ``[3, S]`` of one sample's tokens and its rope delta (HF's ``rope_deltas``: the next position after
    the sample minus ``S``; decoding continues at ``S + delta``, on all three axes).

    Args:
        input_ids: ``[S]`` the sample's ids, each image / video already expanded to its tokens.
        image_grids: ``[N, 3]`` (t, h, w) in patches before the spatial merge (HF ``image_grid_thw``), in the order
            the images occur.
        video_grids: ``[V, 3]`` likewise (HF ``video_grid_thw``: t in temporal patches).
        spatial_merge_size: patches merged per side into one token.
        image_token_id, video_token_id: the ids the items' tokens carry.
        family: a tower kind whose family has a video rule (``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``).
        second_per_grid_ts: Qwen2.5-VL, per video: seconds per temporal grid (default 1 each, as HF).
        tokens_per_second: Qwen2.5-VL's ``vision_config.tokens_per_second``.

    Raises:
        InputError: an item whose tokens in the ids do not number its grid's, or grids left over or missing.
    """
    rules = {kind: spec.video for kind, spec in TOWERS.items() if spec.video is not None}
    if family not in rules:
        raise InputError(f"M-RoPE family must be one of {sorted(rules)}, got {family!r}")
    if image_token_id == video_token_id:
        raise InputError(f"M-RoPE needs distinct image and video token ids, got {image_token_id} for both")
    rule = rules[family]
    ids = input_ids.tolist()
    grids = {image_token_id: _grid_list(image_grids), video_token_id: _grid_list(video_grids)}
    intervals: dict[int, list] = {image_token_id: [None] * len(grids[image_token_id])}
    videos = grids[video_token_id]
    if rule.timed and videos:
        if tokens_per_second is None:
            raise InputError(f"{family} video positions need tokens_per_second")
        seconds = [1.0] * len(videos) if second_per_grid_ts is None else list(second_per_grid_ts)
        if len(seconds) != len(videos):
            raise InputError(f"{len(seconds)} second_per_grid_ts for {len(videos)} videos")
        # float32 as HF computes it (tokens_per_second × the processor's float tensor)
        intervals[video_token_id] = [torch.tensor(float(s)) * tokens_per_second for s in seconds]
    else:
        intervals[video_token_id] = [None] * len(videos)
    if rule.per_frame:
        grids[video_token_id] = [(1, h, w) for t, h, w in videos for _ in range(t)]
        intervals[video_token_id] = [None] * len(grids[video_token_id])
    used = {image_token_id: 0, video_token_id: 0}
    blocks, start, i, merge = [], 0, 0, spatial_merge_size
    while i < len(ids):
        token = ids[i]
        if token in used:
            kind = "image" if token == image_token_id else "video"
            if used[token] == len(grids[token]):
                raise InputError(f"more {kind}s in the ids than the {len(grids[token])} {kind} grids given")
            grid, interval = grids[token][used[token]], intervals[token][used[token]]
            used[token] += 1
            n = grid[0] * (grid[1] // merge) * (grid[2] // merge)
            run = ids[i : i + n]
            if len(run) != n or any(x != token for x in run):
                got = next((k for k, x in enumerate(run) if x != token), len(run))
                raise InputError(
                    f"{kind} {used[token]} of grid {list(grid)} needs {n} consecutive tokens at {i}, found {got}"
                )
            blocks.append(_grid_positions(start, grid, merge, interval))
            start += max(grid[1], grid[2]) // merge
            i += n
        else:
            end = i
            while end < len(ids) and ids[end] not in used:
                end += 1
            blocks.append(torch.arange(start, start + end - i).expand(3, -1))
            start += end - i
            i = end
    for token, count in used.items():
        if count != len(grids[token]):
            kind = "image" if token == image_token_id else "video"
            raise InputError(f"{len(grids[token])} {kind} grids for {count} {kind}s in the ids")
    if not blocks:
        return torch.zeros(3, 0, dtype=torch.long), 0
    positions = torch.cat(blocks, dim=1)
    return positions, int(positions.max()) + 1 - len(ids)


def _grid_list(grids: torch.Tensor | None) -> list[tuple[int, int, int]]:
    return [] if grids is None else [tuple(int(x) for x in g) for g in torch.as_tensor(grids).reshape(-1, 3)]
