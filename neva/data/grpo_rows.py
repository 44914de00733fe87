"""The online RL stage's update rows with each prompt shared by its group: one row per prompt, the prompt once and
then each of its completions, instead of one row per completion that repeats the prompt.

A group's ``G`` completions continue one prompt of ``p`` tokens. As separate rows the update runs the prompt's
forward and backward ``G`` times; here a row is ``[prompt[:-1], (prompt[-1], c_1), ..., (prompt[-1], c_G)]``: the
prompt but its last token, then per completion a segment of that last token and the completion. Each segment attends
the prompt's columns and itself, causally (``neva.models.attention``: ``shared_prefix``), and its positions are the
ones the separate row gives it (the last prompt token's, then from the prompt's largest position + 1 on, as
``neva.data.grpo_prompts.completion_sample`` places them; M-RoPE's three axes alike), so every completion token sees
what it sees in its own row, at the same positions: the same logits. The last prompt token is repeated in each
segment because its logits predict the completion's first token, which differs from completion to completion; the
labels then shift by one within each segment as in a separate row (the segment's first label is not learned).

What the objective needs per completion rather than per row (``neva.training.grpo``): ``completion_at`` ``[B, S]``,
aligned as the per-token log-prob tensors are (column ``t`` predicts label ``t + 1``), the completion each learned
prediction belongs to (-1 elsewhere), and ``row_tokens`` ``[N]``, each completion's learned tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from neva.constants import IGNORE_INDEX
from neva.data.collate import collate_padded

MEDIA_POSITIONS = ("image_positions", "video_positions")


def shared_prompt_sample(
    prompt: dict[str, Any], completions: list[torch.Tensor], learned: list[torch.Tensor]
) -> tuple[dict[str, Any], list[int], list[int]] | None:
    """``(sample, segment ids, each completion's first column)`` of one group's row (see the module docstring), or
    None where the prompt cannot be shared: under two tokens, or its last token a media position (its features would
    have to be repeated per segment)."""
    ids = prompt["input_ids"]
    p = ids.numel()
    if p < 2 or any(key in prompt and bool((prompt[key] == p - 1).any()) for key in MEDIA_POSITIONS):
        return None
    own = prompt["position_ids"] if "position_ids" in prompt else torch.arange(p)[None]
    after = own.amax() + 1
    parts_ids, parts_labels, parts_pos = [ids[:-1]], [torch.full((p - 1,), IGNORE_INDEX)], [own[:, :-1]]
    segments, starts, at = [1] * (p - 1), [], p - 1
    for i, (c, lab) in enumerate(zip(completions, learned)):
        n = c.numel()
        parts_ids += [ids[-1:], c]
        parts_labels += [torch.full((1,), IGNORE_INDEX), lab]
        parts_pos += [own[:, -1:], (after + torch.arange(n, dtype=own.dtype)).expand(own.shape[0], -1)]
        segments += [i + 2] * (n + 1)
        starts.append(at)
        at += n + 1
    sample = {**prompt, "input_ids": torch.cat(parts_ids), "labels": torch.cat(parts_labels),
              "position_ids": torch.cat(parts_pos, dim=-1)}  # fmt: skip
    return sample, segments, starts


def collate_shared_prompts(
    prompts: list[dict[str, Any]],
    completions: list[torch.Tensor],
    learned: list[torch.Tensor],
    group: int,
    pad_id: int,
    pad_to_multiple_of: int,
) -> dict[str, Any] | None:
    """A micro-batch's groups (``group`` consecutive completions per prompt, ``learned`` their labels: the ids, or
    ``IGNORE_INDEX`` where nothing is learned) as shared-prompt rows, with ``shared_prefix``, ``completion_at`` and
    ``row_tokens``; None where some prompt cannot be shared (``shared_prompt_sample``: the caller collates separate
    rows)."""
    built = []
    for g, prompt in enumerate(prompts):
        one = shared_prompt_sample(
            prompt, completions[g * group : (g + 1) * group], learned[g * group : (g + 1) * group]
        )
        if one is None:
            return None
        built.append(one)
    batch = collate_padded([b[0] for b in built], pad_id, pad_to_multiple_of)
    rows, width = batch["input_ids"].shape
    segment_ids = torch.zeros(rows, width, dtype=torch.long)
    completion_at = torch.full((rows, width), -1, dtype=torch.long)
    for r, (_, segments, starts) in enumerate(built):
        segment_ids[r, : len(segments)] = torch.tensor(segments)
        for j, start in enumerate(starts):
            n = completions[r * group + j].numel()
            completion_at[r, start : start + n] = r * group + j  # the segment's columns that predict a completion token
    completion_at = torch.where(batch["labels"].roll(-1, dims=1) != IGNORE_INDEX, completion_at, -1)
    row_tokens = torch.stack([(lab != IGNORE_INDEX).sum() for lab in learned]) if learned else torch.zeros(0)
    return {**batch, "segment_ids": segment_ids, "shared_prefix": True, "completion_at": completion_at,
            "row_tokens": row_tokens.long()}  # fmt: skip
