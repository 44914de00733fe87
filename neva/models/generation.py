"""Autoregressive generation with a KV cache: batched, left-padded prompts; greedy or sampled decoding.

Semantics follow transformers' ``generate`` so that outputs can be compared token for token:

- left padding: pads carry segment 0 (they attend only to each other), real tokens segment 1; RoPE positions start at
  0 on each row's first real token (HF's ``cumsum(attention_mask) - 1``);
- M-RoPE (Qwen2-VL and after): a prompt may bring its own positions ``[3, L]`` (``neva.models.mrope``); each new
  token then takes the row's largest prompt position + 1, + 2, ... on all three axes (HF's ``cache_position +
  rope_deltas``), which is the one-axis next position ``L`` for one-axis prompts;
- logits processing order: repetition penalty → temperature → top-k → top-p (HF's processor then warper order);
- repetition penalty: over every token of the row so far (prompt, image tokens included, and generated), a positive
  logit is divided by the penalty, a negative one multiplied;
- a row stops after emitting an EOS id or once a stop string appears in its decoded output; the stopping token is
  kept in the returned ids (as in HF's output), padding after it is not returned;
- generation also stops when the batch's longest prompt and its answer fill the model's context (``max_seq_len``):
  the KV cache is sized for at most that, whatever ``max_new_tokens`` asks (with a warning); positions beyond it
  were never trained, and an unbounded request would reserve its whole cache up front.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from neva.models.anyres import batch_feature_index
from neva.models.config import NevaConfig
from neva.models.media import Media, MediaInputs
from neva.models.neva import NevaModel
from neva.models.video import find_video_positions


class Lockstep(Protocol):
    """Processes that decode different prompts but must run the same number of forwards (each forward is a collective
    among them: sharded parameters gathered, tokens exchanged between experts). The caller that knows them gives
    this; ``generate`` only asks it two things."""

    def fewest(self, n: int) -> int:
        """The smallest ``n`` among the peers (the step budget every one of them can afford)."""

    def all_done(self, done: bool) -> bool:
        """Whether every peer is done (this one's ``done`` given)."""


@dataclass
class GenerationConfig:
    """Decoding settings. ``temperature == 0`` (or ``do_sample=False``) means greedy.

    NeMo NeVA's inference defaults are temperature 0.2, top-p 0.9, top-k 0, repetition penalty 1.2; greedy is the
    default here because it is reproducible and comparable with HF.
    """

    max_new_tokens: int = 256
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    pad_token_id: int = 0  # fed for left padding and after a row has stopped; never attended to by real tokens
    # Peers that must run the same forwards as this process (``Lockstep``); None: this process decodes alone.
    lockstep: Lockstep | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.do_sample and self.temperature <= 0:
            raise ValueError(f"sampling needs temperature > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.repetition_penalty <= 0:
            raise ValueError("top_k must be >= 0 and repetition_penalty > 0")


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF ``RepetitionPenaltyLogitsProcessor``: ``seen`` ``[B, V]`` bool marks tokens already in each row."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits per row (ties at the k-th value kept, as HF does); others become -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """HF ``TopPLogitsWarper``: drop the tokens whose ascending cumulative probability is ``<= 1 - p`` (keep >= 1)."""
    if p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1 - p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def next_tokens(logits: torch.Tensor, seen: torch.Tensor, cfg: GenerationConfig, generator=None) -> torch.Tensor:
    """Choose one token per row from last-position logits ``[B, V]`` (float32 recommended)."""
    logits = apply_repetition_penalty(logits, seen, cfg.repetition_penalty)
    if not cfg.do_sample:
        return logits.argmax(dim=-1)
    logits = logits / cfg.temperature
    logits = apply_top_p(apply_top_k(logits, cfg.top_k), cfg.top_p)
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=generator).squeeze(-1)


@dataclass
class _Batch:
    input_ids: torch.Tensor  # [B, L] left-padded
    segment_ids: torch.Tensor  # [B, L + max_new] 0 = padding
    position_ids: torch.Tensor  # [P, B, L]: P position axes (1, or M-RoPE's 3), 0 on padding
    lengths: list[int] = field(default_factory=list)

    @property
    def next_positions(self) -> torch.Tensor:
        """``[B]`` the position of each row's first new token: its largest prompt position + 1 (one-axis: its length),
        the same on every axis."""
        return self.position_ids.amax(dim=(0, 2)) + 1


def left_pad(
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    pad_id: int,
    device: torch.device,
    positions: Sequence[torch.Tensor] | None = None,
) -> _Batch:
    """Left-padded ids, segment ids covering prompt + new tokens, and per-row RoPE positions: ``positions`` (each
    prompt's own ``[P, len]``, as ``neva.models.mrope.mrope_positions`` gives them), or ``0..len-1`` on one axis."""
    lengths = [len(p) for p in prompts]
    if not lengths or min(lengths) == 0:
        raise ValueError("every prompt needs at least one token")
    if positions is not None and len(positions) != len(prompts):
        raise ValueError(f"{len(positions)} position tensors for {len(prompts)} prompts")
    width = max(lengths)
    axes = 1 if positions is None else max(p.shape[0] for p in positions)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    segments = torch.ones(len(prompts), width + max_new_tokens, dtype=torch.long)
    position_ids = torch.zeros(axes, len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        start = width - len(prompt)
        ids[row, start:] = torch.as_tensor(list(prompt), dtype=torch.long)
        segments[row, :start] = 0
        own = torch.arange(len(prompt)) if positions is None else positions[row].cpu()
        if own.shape[-1] != len(prompt):
            raise ValueError(f"prompt {row}: {own.shape[-1]} positions for {len(prompt)} tokens")
        position_ids[:, row, start:] = own  # a one-axis row broadcasts over every axis
    return _Batch(ids.to(device), segments.to(device), position_ids.to(device), lengths)


@torch.no_grad()
def generate(
    model: NevaModel,
    prompts: Sequence[Sequence[int]],
    pixel_values: torch.Tensor | None = None,
    image_counts: Sequence[int] | torch.Tensor | None = None,
    config: GenerationConfig | None = None,
    decode: Callable[[list[int]], str] | None = None,
    generator: torch.Generator | None = None,
    image_sizes: Sequence[tuple[int, int] | None] | None = None,
    video_pixel_values: torch.Tensor | None = None,
    position_ids: Sequence[torch.Tensor] | None = None,
    image_grid: torch.Tensor | None = None,
    video_grid: torch.Tensor | None = None,
) -> list[list[int]]:
    """Generate continuations for a batch of prompts.

    Args:
        model: a full (unsplit) neva model, in eval mode.
        prompts: token ids per prompt, image positions already expanded (``num_image_tokens`` image ids per image).
        pixel_values: ``[N, C, H, W]``, all images in prompt order, or None.
        image_counts: images per prompt (default: inferred from the image-token counts).
        config: decoding settings (default: greedy, 256 new tokens, no EOS).
        decode: ids → text, needed for ``stop_strings``.
        generator: RNG for sampling (default: the global one).
        image_sizes: AnyRes models: each image's ``(height, width)`` (None: a fixed-size one); ``pixel_values`` then
            holds every image's tiles (``neva.data.anyres.tile_image``) and each image takes its own positions.
        video_pixel_values: ``[F, C, H, W]``, every frame of every video in prompt order (each video's
            ``NevaConfig.video_tokens(frames)`` positions already expanded to ``video_token`` ids).
        video_grid: a native-resolution tower's ``[V, 3]`` temporal-patch grid of each video
            (``video_pixel_values`` then holds their flattened patches).
        image_grid: a native-resolution tower's ``[N, 3]`` patch grid of each image (``pixel_values`` then holds
            their flattened patches, ``neva.data.qwen_images``).
        position_ids: per prompt its RoPE positions ``[P, len]`` (M-RoPE: ``[3, len]`` from
            ``neva.models.mrope.mrope_positions``); None: ``0..len-1``.

    Returns:
        The new token ids of each prompt, ending with the EOS / stop token that ended it, if any.
    """
    cfg = config or GenerationConfig()
    if cfg.stop_strings and decode is None:
        raise ValueError("stop_strings need a decode function")
    cfg = _fit_context(cfg, max((len(p) for p in prompts), default=0), model.cfg.llm.max_seq_len)
    if cfg.lockstep is not None:  # every peer stops at the same step when none has stopped before
        cfg = replace(cfg, max_new_tokens=cfg.lockstep.fewest(cfg.max_new_tokens))
    device = next(model.parameters()).device
    batch = left_pad(prompts, cfg.max_new_tokens, cfg.pad_token_id, device, position_ids)
    b, width = batch.input_ids.shape
    out: list[list[int]] = [[] for _ in range(b)]
    if cfg.max_new_tokens == 0:
        return out
    media = _media(
        model.cfg, batch.input_ids, pixel_values, image_counts, image_sizes, video_pixel_values, image_grid, video_grid
    )
    vocab = model.cfg.llm.vocab_size
    seen = torch.zeros(b, vocab, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        ids = torch.as_tensor(list(prompt), device=device)
        # An image token without a vocabulary row (image_token_id == vocab) is never generated: not a class here.
        seen[row, ids[ids < vocab]] = True
    eos = torch.tensor(cfg.eos_token_ids or [-1], device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    next_positions = batch.next_positions

    cache = model.new_cache(b, width + cfg.max_new_tokens)
    logits = model(
        batch.input_ids,
        media,
        position_ids=batch.position_ids,
        segment_ids=batch.segment_ids[:, :width],
        cache=cache,
    )[:, -1]
    for step in range(cfg.max_new_tokens):
        token = next_tokens(logits.float(), seen, cfg, generator)
        token = token.masked_fill(done, cfg.pad_token_id)
        for row in (~done).nonzero().flatten().tolist():
            out[row].append(int(token[row]))
        seen[torch.arange(b, device=device), token] |= ~done
        done |= torch.isin(token, eos)
        if decode is not None and cfg.stop_strings:
            for row in (~done).nonzero().flatten().tolist():
                if any(s in decode(out[row]) for s in cfg.stop_strings):
                    done[row] = True
        finished = bool(done.all()) or step == cfg.max_new_tokens - 1
        if cfg.lockstep.all_done(finished) if cfg.lockstep is not None else finished:
            break  # (a finished row of a process whose peers go on is fed padding: its answer is already complete)
        pos = (next_positions + step)[None, :, None]  # one axis: equal on M-RoPE's three (rope_cos_sin)
        logits = model(
            token[:, None], position_ids=pos, segment_ids=batch.segment_ids[:, : width + step + 1], cache=cache
        )[:, -1]
    return out


def _media(
    cfg: NevaConfig,
    input_ids: torch.Tensor,
    pixel_values: torch.Tensor | None,
    image_counts: Sequence[int] | torch.Tensor | None,
    image_sizes: Sequence[tuple[int, int] | None] | None,
    video_pixel_values: torch.Tensor | None,
    image_grid: torch.Tensor | None = None,
    video_grid: torch.Tensor | None = None,
) -> Media:
    """The prompts' images and videos: positions found by the model from the ids of the left-padded batch (padding
    moved them), AnyRes layouts from the images' sizes."""
    device = input_ids.device
    image = video = None
    if pixel_values is not None:
        counts = None if image_counts is None else torch.as_tensor(list(image_counts), device=device)
        image = MediaInputs(pixel_values.to(device), items_per_row=counts)
        if image_grid is not None:  # each image's positions: its merged grid (t·h·w / merge²)
            tokens = image_grid.prod(-1) // cfg.vision.spatial_merge_size**2
            image = replace(image, grid=image_grid, tokens=tokens.to(device))
        if image_sizes is not None:
            lay, tokens = batch_feature_index(cfg.anyres, cfg.num_image_tokens, cfg.vision.image_size, image_sizes)
            weight = None if lay.weight is None else lay.weight.to(device)
            image = replace(
                image, index=lay.index.to(device), tokens=torch.tensor(tokens, device=device), weight=weight
            )
    if video_pixel_values is not None:
        positions = find_video_positions(input_ids, cfg.video_token)
        video = MediaInputs(video_pixel_values.to(device), positions=positions, grid=video_grid)
        if cfg.video_token == cfg.image_token_id and image is not None:  # one id: the positions cannot tell them apart
            raise ValueError("images and videos in one batch need a model whose video_token_id is its own")
    return Media(image=image, video=video)


def _fit_context(cfg: GenerationConfig, width: int, context: int) -> GenerationConfig:
    """``cfg`` with ``max_new_tokens`` cut to what the model's context leaves after the longest prompt (``width``).

    Raises:
        ValueError: a prompt that fills the context on its own.
    """
    if width >= context:
        raise ValueError(f"a prompt of {width} tokens leaves no room in the model's context of {context} tokens")
    if width + cfg.max_new_tokens <= context:
        return cfg
    # One message per max_new_tokens (Python shows a warning once per text), not one per batch.
    warnings.warn(
        f"max_new_tokens={cfg.max_new_tokens} does not fit in the model's context (max_seq_len={context}) after the "
        "prompts: answers stop when a batch's longest prompt and its answer fill it",
        stacklevel=3,
    )
    return replace(cfg, max_new_tokens=context - width)
