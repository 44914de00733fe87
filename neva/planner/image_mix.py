"""``plan.image_tokens=data``: the mean AnyRes image workload of the configured data, measured from image headers.

A seeded sample of at most ``SAMPLE_RECORDS`` of the records with images (all of them when there are fewer) is read
from ``model.data.data_path`` (LLaVA JSON / JSONL); each image's size comes from its file header (PIL, no decode:
``ImageSource.size``, what length grouping reads), and its positions and tiles from the data side's one rule
(``AnyResProcessor.layout_sizes`` + ``feature_index``: OneVision's multi-image samples are one padded tile per image).
A record whose image cannot be read is skipped and counted by reason, as training would skip it; so are the file's
unreadable lines. Blend weights (``concat_sampling_probabilities``) are not applied: the files' records are pooled.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from neva.data.anyres import AnyResProcessor
from neva.data.config import SYNTHETIC, DataConfig
from neva.data.images import ImageError, image_source_for
from neva.data.records import ERROR_KEY, is_shard_spec, load_records, record_images
from neva.models.anyres import feature_index
from neva.models.config import NevaConfig
from neva.typed import ConfigError

SAMPLE_RECORDS = 2000
SEED = 0


@dataclass(frozen=True)
class ImageMix:
    """What the survey saw: ``images`` counted (of ``records`` sampled out of ``population`` records with images),
    their mean decoder ``tokens`` and ``tiles`` per image, and the ``skipped`` records by reason."""

    images: int
    records: int
    population: int
    tokens: float
    tiles: float
    skipped: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        skips = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) or "none"
        return (
            f"measured from model.data.data_path: {self.images} images of {self.records} records sampled of "
            f"{self.population} with images (seed {SEED}), mean {self.tokens:.1f} positions, {self.tiles:.2f} tiles; "
            f"skipped: {skips}"
        )


def measure_image_mix(model: NevaConfig, data: DataConfig, limit: int = SAMPLE_RECORDS) -> ImageMix:
    """The mean positions and tiles per image of ``data`` under ``model``'s AnyRes (see the module docstring).

    Raises:
        ConfigError: a model without AnyRes, synthetic or ``.tar`` data, no record with an image, or no image that
            could be read.
    """
    if model.anyres is None or model.vision is None:
        raise ConfigError("plan.image_tokens=data needs an AnyRes model (model.mm_cfg.image_grid_pinpoints)")
    paths = [data.data_path] if isinstance(data.data_path, str) else list(data.data_path)
    if any(p == SYNTHETIC or is_shard_spec(p) or not p.endswith((".json", ".jsonl")) for p in paths):
        raise ConfigError(
            f"plan.image_tokens=data reads LLaVA .json / .jsonl files, but model.data.data_path={data.data_path!r}; "
            "give the mean positions per image instead (plan.image_tokens=N)"
        )
    # One survey per model and data: a sweep or a search plans many layouts of the same data.
    key = (repr(model.anyres), model.num_image_tokens, model.vision.image_size, tuple(paths), data.image_folder,
           data.max_image_pixels, limit)  # fmt: skip
    if key not in _SURVEYS:
        _SURVEYS[key] = _measure(model, paths, data.image_folder, data.max_image_pixels, limit)
    return _SURVEYS[key]


_SURVEYS: dict[tuple, ImageMix] = {}


def _measure(model: NevaConfig, paths: list[str], folder: str | None, max_pixels: int, limit: int) -> ImageMix:
    skipped: Counter[str] = Counter()
    population = []
    for path in paths:
        for rec in load_records(path):
            if ERROR_KEY in rec:
                skipped[rec[ERROR_KEY]] += 1
            elif record_images(rec):
                population.append(rec)
    if not population:
        raise ConfigError(f"plan.image_tokens=data: no record with an image in {list(paths)}")
    chosen = population if len(population) <= limit else random.Random(SEED).sample(population, limit)
    source = image_source_for(folder, max_pixels)
    processor = AnyResProcessor(model)
    images = tokens = tiles = 0
    for rec in chosen:
        try:
            sizes = [source.size(name) for name in record_images(rec)]
        except ImageError as err:
            skipped[err.reason] += 1
            continue
        for size in processor.layout_sizes(sizes):
            lay = feature_index(model.anyres, model.num_image_tokens, model.vision.image_size, size)
            images, tokens, tiles = images + 1, tokens + lay.tokens, tiles + lay.tiles
    if not images:
        raise ConfigError(f"plan.image_tokens=data: none of the {len(chosen)} sampled records' images could be read "
                          f"({dict(skipped)}); check model.data.image_folder={folder!r}")  # fmt: skip
    return ImageMix(images, len(chosen), len(population), tokens / images, tiles / images, dict(skipped))
