"""A small LLaVA-format data set on disk for the layout tests: what real data looks like to the pipeline.

Variable lengths (roughly 100–400 tokens with the synthetic byte-level tokenizer), text-only samples, two-image
samples, multi-turn conversations and images of mixed sizes, so micro-batches differ in length and image count from
step to step and from one data-parallel replica to another.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
from PIL import Image

WORDS = [
    "red",
    "green",
    "blue",
    "yellow",
    "circle",
    "square",
    "triangle",
    "star",
    "small",
    "large",
    "left",
    "right",
    "top",
    "bottom",
    "corner",
    "center",
    "shape",
    "color",
    "image",
    "picture",
    "shows",
    "there",
    "is",
    "are",
    "a",
    "the",
    "of",
    "on",
    "in",
    "with",
    "and",
    "next",
    "to",
    "near",
    "far",
    "above",
    "below",
    "bright",
    "dark",
]
SIZES = [(40, 30), (32, 32), (64, 48), (20, 50), (50, 20)]


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."


def write_llava_set(directory: Path, n: int = 64, seed: int = 0) -> tuple[Path, Path]:
    """Write ``n`` LLaVA records (``data.json``) and their images (``images/``); returns both paths."""
    rng = random.Random(seed)
    images = directory / "images"
    images.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        n_images = 0 if i % 7 == 3 else 2 if i % 5 == 1 else 1
        names = []
        for k in range(n_images):
            name = f"{i:03d}_{k}.png"
            w, h = SIZES[(i + k) % len(SIZES)]
            pixels = np.random.default_rng(seed * 1000 + i * 10 + k).integers(0, 256, (h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(images / name)
            names.append(name)
        question = "<image>\n" * n_images + _sentence(rng, 4, 14)
        conversations = [{"from": "human", "value": question}, {"from": "gpt", "value": _sentence(rng, 8, 60)}]
        for _ in range(rng.choice([0, 0, 1, 2])):  # multi-turn
            conversations += [
                {"from": "human", "value": _sentence(rng, 3, 10)},
                {"from": "gpt", "value": _sentence(rng, 5, 30)},
            ]
        record = {"id": f"s{i}", "conversations": conversations}
        if n_images == 1:
            record["image"] = names[0]
        elif n_images:
            record["image"] = names
        records.append(record)
    path = directory / "data.json"
    path.write_text(json.dumps(records))
    return path, images


def llava_overrides(directory: Path, packing: bool) -> list[str]:
    """Config overrides that train on the set in ``directory`` (written by ``write_llava_set``)."""
    return [
        "data=llava",
        f"model.data.data_path={directory / 'data.json'}",
        f"model.data.image_folder={directory / 'images'}",
        "model.data.conv_template=vicuna_v1",
        "model.data.num_workers=0",
        f"model.data.packing={str(packing).lower()}",
    ]
