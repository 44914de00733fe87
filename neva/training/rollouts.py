"""Where the online RL stage's completions come from: an interface, and the one implementation that runs inside the
training run on the training model.

``Rollouts`` is what the stage's step asks: ``sample(prompts, group, seeds)`` → ``group`` completions (token ids) per
prompt sample, prompt-major, by the policy's current weights; ``weights_updated()`` after every optimizer update.

``InRunRollouts`` (the default, every layout) generates with neva's batched KV-cache generation
(``neva.models.generation.generate``) on this rank's parts of the training model
(``neva.parallel.generation_model.LayoutGenerationModel``): under FSDP2 each forward gathers its layers' shards as
training's does, under TP each rank holds its own heads and caches (under sequence parallelism each forward padded to
the tensor-parallel multiple), under PP the stages pass hidden states in chunk order; nothing is gathered whole on one
rank. Each prompt (and its images) is prefilled once and its cache repeated
for the group (``generate(repeats=group)``). Every row samples from its own generator seeded by
``rollout_seed(seed, step, prompt key, j)``, so a completion depends on its prompt, the weights and the seed alone,
not on which rank or batch generated it: layouts give the same completions. Nothing is to do after an update (the
weights generated with are the ones trained).

An inference engine can take its place (vLLM on GPU: its own copy of the weights, synced in ``weights_updated``,
prompts sent as ids with the images, ``n=group``, ``seed`` per request); its completions are then sampled by another
kernel and a recorded old log-prob is the training model's recomputation (``record_old_logps``), as TRL and veRL do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from neva.models.generation import GenerationConfig, generate
from neva.parallel.generation_model import LayoutGenerationModel

_MIX = 0x9E3779B97F4A7C15  # 64-bit golden-ratio constant: the seed's parts mixed, not added


def rollout_seed(seed: int, step: int, key: int, j: int) -> int:
    """The sampling seed of completion ``j`` of the prompt with global index ``key`` at rollout ``step``."""
    h = seed & (2**64 - 1)
    for part in (step, key, j):
        h = ((h ^ (part & (2**64 - 1))) * _MIX + 1) & (2**64 - 1)
    return h & (2**63 - 1)


def generation_inputs(prompts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``generate``'s inputs for prompt samples (the data path's, ``neva.data.grpo_prompts``): the ids, every image's
    tower inputs with its images' counts, and what each family's front end adds — AnyRes: each image's size (its
    layout over its tiles); native resolution: each image's / video's patch grid and the prompt's M-RoPE positions;
    videos: their frames (or temporal patches)."""
    pixels = [p["pixel_values"] for p in prompts if p["pixel_values"].shape[0]]
    grids = [p["image_grid"] for p in prompts if "image_grid" in p and p["image_grid"].shape[0]]
    videos = [p["video_pixel_values"] for p in prompts if "video_pixel_values" in p]
    video_grids = [p["video_grid"] for p in prompts if "video_grid" in p]
    tiled = any("image_sizes" in p for p in prompts)
    return {
        "prompts": [p["input_ids"].tolist() for p in prompts],
        "pixel_values": torch.cat(pixels) if pixels else None,
        "image_counts": [int(p.get("image_count", p["pixel_values"].shape[0])) for p in prompts] if pixels else None,
        "image_sizes": [s for p in prompts for s in p.get("image_sizes", ())] if tiled else None,
        "image_grid": torch.cat(grids) if grids else None,
        "video_pixel_values": torch.cat(videos) if videos else None,
        "video_grid": torch.cat(video_grids) if video_grids else None,
        "position_ids": [p["position_ids"] for p in prompts] if any("position_ids" in p for p in prompts) else None,
    }


class Rollouts(Protocol):
    def sample(self, prompts: Sequence[dict[str, Any]], group: int, seeds: Sequence[int]) -> list[list[int]]:
        """``group`` completions of each prompt sample (``input_ids`` with its images' positions expanded,
        ``pixel_values``, ``image_count``), prompt-major; ``seeds``: one per completion, the same order."""
        ...

    def weights_updated(self) -> None:
        """The policy's weights changed (an inference engine syncs its copy here)."""
        ...


class InRunRollouts:
    """Rollouts on the training engine's own model (see the module docstring).

    Args:
        engine: the training engine (its parallelized model and precision).
        decoding: temperature, top-p, top-k, max new tokens, stop strings, EOS and pad ids.
        decode: ids → text (stop strings).
    """

    def __init__(self, engine: Any, decoding: GenerationConfig, decode: Callable[[list[int]], str]) -> None:
        self.engine = engine
        self.decoding = decoding
        self.decode = decode

    def sample(self, prompts: Sequence[dict[str, Any]], group: int, seeds: Sequence[int]) -> list[list[int]]:
        model = LayoutGenerationModel(self.engine.parallel, self.engine.autocast)
        device = self.engine.device
        generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        modes = [m.training for m in self.engine.parts]
        for part in self.engine.parts:
            part.eval()
        try:
            out = generate(
                model,
                config=self.decoding,
                decode=self.decode,
                generator=generators,
                repeats=group,
                # FSDP2 / EP: every forward is a collective of the data-parallel ranks, which roll out other prompts
                all_steps=not model.shares_questions,
                **generation_inputs(prompts),
            )
        finally:
            model.finish()
            for part, mode in zip(self.engine.parts, modes):
                part.train(mode)
        return out

    def weights_updated(self) -> None:
        return None
