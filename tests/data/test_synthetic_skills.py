"""The skills suite (the canary's data): deterministic, every answer read back from the pixels by an independent rule,
and trainable through the data module (text-only, one- and two-image samples in one batch)."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys

import numpy as np

from neva.data.builtin_sets import BUILTIN_SETS
from neva.data.config import DataConfig
from neva.data.datamodule import NevaDataModule
from neva.data.synthetic import COLORS
from neva.data.synthetic_skills import (
    GRID,
    SKILLS,
    TRAINING_ROTATION,
    TURNS,
    SkillImages,
    skill_sample,
    skills_eval_records,
    skills_records,
)
from neva.models.presets import build_config

WORDS = [str(n) for n in range(10)]


def read_objects(image) -> list[tuple[int, int, str, str]]:
    """(row, col, colour, shape) of every object, from the pixels alone: the palette colour that fills a cell of the
    grid (``GRID`` cells a side), and its shape from how much of its bounding box it fills (square ~1, circle ~π/4, triangle ~1/2)."""
    px = np.asarray(image).astype(int)
    cell = px.shape[0] // GRID
    found = []
    for row in range(GRID):
        for col in range(GRID):
            block = px[row * cell : (row + 1) * cell, col * cell : (col + 1) * cell]
            hits = {name: (block == rgb).all(-1) for name, rgb in COLORS.items()}
            hits = {name: m for name, m in hits.items() if m.sum() > 0}
            if not hits:
                continue
            assert len(hits) == 1, (row, col, list(hits))
            ((color, mask),) = hits.items()
            ys, xs = np.nonzero(mask)
            fill = mask.sum() / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
            shape = "square" if fill > 0.9 else "circle" if fill > 0.65 else "triangle"
            found.append((row, col, color, shape))
    return found


def expected_answer(question: str, scenes: list[list[tuple[int, int, str, str]]]) -> str:
    """The answer to ``question`` about the objects read from its images (the suite's rules, restated)."""
    if question == "How many objects are there?":
        return WORDS[len(scenes[0])]
    if question == "Which image has more objects?":
        assert len(scenes[0]) != len(scenes[1])
        return "first" if len(scenes[0]) > len(scenes[1]) else "second"
    if m := re.fullmatch(r"What is (\d) plus (\d)\?", question):
        assert not scenes
        return str(int(m[1]) + int(m[2]))
    if m := re.fullmatch(r"Is the (\w+) (\w+) (left of|above) the (\w+) (\w+)\?", question):
        (a,) = [o for o in scenes[0] if o[2:] == (m[1], m[2])]
        (b,) = [o for o in scenes[0] if o[2:] == (m[4], m[5])]
        axis = 1 if m[3] == "left of" else 0
        assert a[axis] != b[axis], question
        return "yes" if a[axis] < b[axis] else "no"
    if m := re.fullmatch(r"What color is the (\w+)\?", question):
        (obj,) = [o for o in scenes[0] if o[3] == m[1]]
        return obj[2]
    if m := re.fullmatch(r"What shape is the (\w+) one\?", question):
        (obj,) = [o for o in scenes[0] if o[2] == m[1]]
        return obj[3]
    raise AssertionError(f"no rule for {question!r}")


def test_every_answer_follows_from_the_pixels():
    for size in (64, 96):  # the canary's 32 px, doubled and tripled: shapes large enough to tell apart by fill
        images = SkillImages(0, size)
        for split in ("train", "val"):
            for record in skills_records(0, split, 250, "qa"):
                conv = record["conversations"]
                names = record.get("image", [])
                tags = conv[0]["value"].count("<image>\n")
                assert tags == len(names) and conv[0]["value"].startswith("<image>\n" * tags)
                assert "<image>" not in "".join(turn["value"] for turn in conv[1:])
                scenes = [read_objects(images(n)) for n in names]
                questions = [conv[0]["value"][tags * len("<image>\n") :]] + [t["value"] for t in conv[2::2]]
                assert len(set(questions)) == len(questions) == len(conv) // 2, record  # no question asked twice
                for question, gpt in zip(questions, conv[1::2]):
                    assert expected_answer(question, scenes) == gpt["value"], record
    for record in skills_records(0, "train", 50, "caption"):
        objects = read_objects(SkillImages(0, 96)(record["image"]))
        text = record["conversations"][1]["value"]
        assert text == f"{WORDS[len(objects)]}: " + ", ".join(f"{c} {s}" for _, _, c, s in objects)


def _digest(seed: int) -> str:
    h = hashlib.sha256()
    for task in ("caption", "qa"):
        for record in skills_records(seed, "train", 40, task):
            h.update(repr(record).encode())
            for name in [record["image"]] if isinstance(record.get("image"), str) else record.get("image", []):
                h.update(SkillImages(seed, 32)(name).tobytes())
    for r in skills_eval_records(32, seed, 20):
        h.update(repr((r.question, r.answer, r.skill)).encode() + b"".join(i.tobytes() for i in r.images))
    return h.hexdigest()


def test_same_seed_same_samples_in_another_process():
    code = "from tests.data.test_synthetic_skills import _digest; print(_digest(0))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == _digest(0) != _digest(1)


def test_skills_in_equal_shares_held_out_and_in_the_rotation_in_training():
    evals = skills_eval_records(32, num_samples=10 * len(SKILLS))
    counts = {name: sum(r.skill == name for r in evals) for name in SKILLS}
    assert set(counts.values()) == {10}
    train = [skill_sample(0, "train", i) for i in range(10 * len(TRAINING_ROTATION))]
    assert [s.skill for s in train] == list(TRAINING_ROTATION) * 10 and set(TRAINING_ROTATION) == set(SKILLS)
    turns = {name: {1 + len(s.follow_ups) for s in train if s.skill == name} for name in SKILLS}
    assert turns == {"count": {1}, "relation": {1, TURNS}, "binding": {TURNS}, "compare": {1}, "text": {1}}
    assert {len(r.images) for r in evals} == {0, 1, 2}
    answers = {r.answer for r in skills_eval_records(32, num_samples=500) if r.skill == "count"}
    assert answers == set(WORDS[5:])  # beyond subitising: 5-9


def test_data_module_trains_mixed_image_counts(synthetic_tokenizer):
    cfg = build_config(image_token_id=synthetic_tokenizer.convert_tokens_to_ids("<image>"))
    data = DataConfig(data_path="synthetic_skills", synthetic_train_samples=16, conv_template="vicuna_v1")
    dm = NevaDataModule(data, synthetic_tokenizer, cfg, micro_batch_size=16)  # two rotations: every skill
    batch = next(iter(dm.train_dataloader()))
    counts = batch.media.image.items_per_row
    assert sorted(set(counts.tolist())) == [0, 1, 2]
    assert batch.media.image.pixels.shape[0] == int(counts.sum())
    assert ((batch.input_ids == cfg.image_token_id).sum(1) == counts * cfg.num_image_tokens).all()
    assert "synthetic_skills" in BUILTIN_SETS and dm.skip_tracker.used == 16
