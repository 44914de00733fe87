"""Built-in skills suite: synthetic questions meant to be learned only partly by a small model in a short run (the quality canary's data).

Today's coloured-shapes set (``neva.data.synthetic``) saturates: a tiny model answers all of it. This suite asks for
skills that take longer to learn, each a generator in ``SKILLS`` (the registry new tasks join, e.g. tiled detail or
video questions, by adding a ``Skill``):

- ``count``: 5–9 objects on a 4×4 grid (beyond subitising), "How many objects are there?"
- ``relation``: two named objects among two or three, "Is the red circle left of the blue square?" (yes / no); a
  training sample asks it of up to ``TURNS`` distinct pairs
- ``binding``: three objects of distinct shapes and colours, "What color is the triangle?" / "What shape is the red
  one?"; a training sample asks it of all three objects, in one form
- ``compare``: two images in one sample, "Which image has more objects?" (first / second)
- ``text``: no image, "What is 2 plus 3?" (sums up to 8)

As in ``neva.data.synthetic``, everything is a pure function of ``(seed, split, index)``: records are cheap dicts
and images are drawn on demand from their names (``SkillImages``), with that module's shape drawing. Training sample
``index`` asks skill ``index`` of ``TRAINING_ROTATION`` (binding, the skill that needs the most samples, in half of
them); held-out sample ``index`` asks skill ``index % len(SKILLS)`` with its first question only, so the held-out
split holds the skills in equal shares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from neva.constants import IMAGE_TOKEN
from neva.data.synthetic import COLORS, SHAPES, SPLITS, draw_shape

GRID = 4  # cells per side: 8 px cells at 32 px, one vision patch each
# Numbers are answered in digits: one byte-level token each (the built-in tokenizer has no merges for "seven"), so a
# number is one decision for the model, like the colour and shape words.
DIGITS = tuple(str(n) for n in range(10))
TASKS = ("caption", "qa")
TURNS = 3  # questions about one image in a binding or relation training sample, as LLaVA's conversations ask several
# The order training asks the skills in: binding, which needs the most samples, in half of them (docs/TRAINING.md,
# "The quality canary"). Held-out questions take the skills in equal shares.
TRAINING_ROTATION = ("binding", "count", "binding", "compare", "binding", "relation", "binding", "text")
_SALT = 21  # keeps this suite's random streams apart from neva.data.synthetic's for the same seed


@dataclass(frozen=True)
class Thing:
    """One object: a shape of a colour in a grid cell (row-major index)."""

    shape: str
    color: str
    cell: int

    @property
    def name(self) -> str:
        return f"{self.color} {self.shape}"

    @property
    def row(self) -> int:
        return self.cell // GRID

    @property
    def col(self) -> int:
        return self.cell % GRID


@dataclass(frozen=True)
class Scene:
    """What one image shows: objects in distinct cells on a grey background."""

    things: tuple[Thing, ...]
    background: int

    def caption(self) -> str:
        """Pretraining caption: the objects in reading order, e.g. ``2: red circle, blue square``."""
        things = sorted(self.things, key=lambda t: t.cell)
        return f"{DIGITS[len(things)]}: " + ", ".join(t.name for t in things)


Turns = tuple[tuple[str, str], ...]
"""A sample's ``(question, answer)`` exchanges about its images, in order; the first is the held-out question's."""


@dataclass(frozen=True)
class SkillSample:
    """One sample of a skill: its images' scenes (0, 1 or 2), the bare question (no ``<image>`` tags) and answer, and
    the further exchanges a training conversation holds about the same images (``follow_ups``)."""

    skill: str
    scenes: tuple[Scene, ...]
    question: str
    answer: str
    follow_ups: Turns = ()


@dataclass(frozen=True)
class Skill:
    """A skill of the suite: ``make(rng)`` draws one ``(scenes, turns)``; ``chance`` is the accuracy of guessing
    uniformly among its possible answers (what the controls should approach when the image matters)."""

    name: str
    make: Callable[[np.random.Generator], tuple[tuple[Scene, ...], Turns]]
    chance: float


def random_scene(rng: np.random.Generator, n: int, distinct_names: bool = False) -> Scene:
    """``n`` objects in distinct random cells; ``distinct_names``: no two share both colour and shape."""
    cells = rng.choice(GRID * GRID, size=n, replace=False)
    combos = [(s, c) for s in SHAPES for c in COLORS]
    if distinct_names:
        picks = [combos[int(i)] for i in rng.choice(len(combos), size=n, replace=False)]
    else:
        picks = [combos[int(i)] for i in rng.integers(len(combos), size=n)]
    things = tuple(Thing(shape, color, int(cell)) for (shape, color), cell in zip(picks, cells))
    return Scene(things, int(rng.integers(0, 60)))


def _count(rng: np.random.Generator) -> tuple[tuple[Scene, ...], Turns]:
    n = int(rng.integers(5, 10))
    return (random_scene(rng, n),), (("How many objects are there?", DIGITS[n]),)


def _relation(rng: np.random.Generator) -> tuple[tuple[Scene, ...], Turns]:
    scene = random_scene(rng, int(rng.integers(2, 4)), distinct_names=True)
    pairs = [(a, b) for i, a in enumerate(scene.things) for b in scene.things[i + 1 :]]
    turns = []
    for k in rng.permutation(len(pairs))[:TURNS]:  # distinct pairs: no turn is the converse of an earlier one
        a, b = pairs[int(k)][:: -1 if rng.integers(2) else 1]
        relations = [r for r, differs in (("left of", a.col != b.col), ("above", a.row != b.row)) if differs]
        relation = relations[int(rng.integers(len(relations)))]
        holds = a.col < b.col if relation == "left of" else a.row < b.row
        turns.append((f"Is the {a.name} {relation} the {b.name}?", "yes" if holds else "no"))
    return (scene,), tuple(turns)


def _binding(rng: np.random.Generator) -> tuple[tuple[Scene, ...], Turns]:
    colors = [list(COLORS)[int(i)] for i in rng.choice(len(COLORS), size=len(SHAPES), replace=False)]
    cells = rng.choice(GRID * GRID, size=len(SHAPES), replace=False)
    things = tuple(Thing(s, c, int(cell)) for s, c, cell in zip(SHAPES, colors, cells))
    scene = Scene(things, int(rng.integers(0, 60)))
    targets = [things[int(i)] for i in rng.permutation(len(things))[:TURNS]]
    # One form a sample: a colour question and a shape question about the same object would answer each other.
    if rng.integers(2):
        return (scene,), tuple((f"What color is the {t.shape}?", t.color) for t in targets)
    return (scene,), tuple((f"What shape is the {t.color} one?", t.shape) for t in targets)


def _compare(rng: np.random.Generator) -> tuple[tuple[Scene, ...], Turns]:
    first, second = (int(n) for n in rng.choice(np.arange(1, 7), size=2, replace=False))
    scenes = (random_scene(rng, first), random_scene(rng, second))
    return scenes, (("Which image has more objects?", "first" if first > second else "second"),)


def _text(rng: np.random.Generator) -> tuple[tuple[Scene, ...], Turns]:
    a, b = (int(x) for x in rng.integers(0, 5, size=2))
    return (), ((f"What is {a} plus {b}?", DIGITS[a + b]),)


SKILLS: dict[str, Skill] = {
    s.name: s
    for s in (
        Skill("count", _count, 1 / 5),
        Skill("relation", _relation, 1 / 2),
        Skill("binding", _binding, 1 / 3),
        Skill("compare", _compare, 1 / 2),
        Skill("text", _text, 1 / 9),
    )
}


def skill_sample(seed: int, split: str, index: int) -> SkillSample:
    """Sample ``index`` of ``split`` (deterministic): skill ``index`` in ``TRAINING_ROTATION`` for ``train``, in the
    order of ``SKILLS`` for the held-out ``val``."""
    rotation = TRAINING_ROTATION if split == "train" else tuple(SKILLS)
    skill = SKILLS[rotation[index % len(rotation)]]
    scenes, ((question, answer), *follow_ups) = skill.make(np.random.default_rng([seed, SPLITS[split], index, _SALT]))
    return SkillSample(skill.name, scenes, question, answer, tuple(follow_ups))


def caption_scene(seed: int, split: str, index: int) -> Scene:
    """The scene of pretraining caption ``index`` (1–9 objects)."""
    rng = np.random.default_rng([seed, SPLITS[split], index, _SALT, 1])
    return random_scene(rng, int(rng.integers(1, 10)))


def draw_skill_scene(scene: Scene, size: int) -> Image.Image:
    """Render a scene as an RGB image of ``size`` × ``size`` pixels (one object per grid cell, centred)."""
    img = Image.new("RGB", (size, size), (scene.background,) * 3)
    draw = ImageDraw.Draw(img)
    cell = size / GRID
    margin = cell / 8
    for t in scene.things:
        x0, y0 = t.col * cell + margin, t.row * cell + margin
        draw_shape(draw, t.shape, t.color, (x0, y0, x0 + cell - 2 * margin, y0 + cell - 2 * margin))
    return img


def image_name(task: str, split: str, index: int, k: int) -> str:
    """Name of image ``k`` of sample ``index`` in records (resolved by ``SkillImages``)."""
    return f"{task}/{split}/{index:06d}-{k}.png"


def sample_scenes(seed: int, task: str, split: str, index: int) -> tuple[Scene, ...]:
    """The scenes of record ``index`` of ``task`` (``caption``: one scene; ``qa``: the question's 0–2)."""
    if task == "caption":
        return (caption_scene(seed, split, index),)
    return skill_sample(seed, split, index).scenes


class SkillImages:
    """Picklable name → image function for ``CallableImageSource``."""

    def __init__(self, seed: int, image_size: int) -> None:
        self.seed = seed
        self.image_size = image_size

    def __call__(self, name: str) -> Image.Image:
        task, split, file = (name.split("/") + ["", ""])[:3]
        if task not in TASKS or split not in SPLITS or not file.endswith(".png"):
            raise KeyError(name)
        index, _, k = file[: -len(".png")].partition("-")
        return draw_skill_scene(sample_scenes(self.seed, task, split, int(index))[int(k)], self.image_size)


def make_record(seed: int, split: str, index: int, task: str) -> dict[str, Any]:
    """LLaVA-format record ``index``: a caption (``task="caption"``) or one skill question (``"qa"``)."""
    rid = f"skills-{split}-{index}"
    if task == "caption":
        conv = [
            {"from": "human", "value": f"{IMAGE_TOKEN}\nDescribe the image."},
            {"from": "gpt", "value": caption_scene(seed, split, index).caption()},
        ]
        return {"id": rid, "image": image_name(task, split, index, 0), "conversations": conv}
    s = skill_sample(seed, split, index)
    conv = [
        {"from": "human", "value": f"{IMAGE_TOKEN}\n" * len(s.scenes) + s.question},
        {"from": "gpt", "value": s.answer},
    ]
    for question, answer in s.follow_ups:
        conv += [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    record: dict[str, Any] = {"id": rid, "conversations": conv}
    if s.scenes:
        record["image"] = [image_name(task, split, index, k) for k in range(len(s.scenes))]
    return record


def skills_records(seed: int, split: str, num_samples: int, task: str) -> list[dict[str, Any]]:
    """``num_samples`` records of ``split`` (``train`` or the held-out ``val``)."""
    return [make_record(seed, split, i, task) for i in range(num_samples)]


@dataclass(frozen=True)
class SkillEvalRecord:
    """One held-out question: its images (rendered), bare question, exact answer and skill."""

    id: str
    images: tuple[Image.Image, ...]
    question: str
    answer: str
    skill: str


def skills_eval_records(image_size: int, seed: int = 0, num_samples: int = 500) -> list[SkillEvalRecord]:
    """The first ``num_samples`` held-out (``val``) questions, skills in rotation; the evaluator puts one
    ``<image>`` tag per image in front of the question, as training does."""
    out = []
    for i in range(num_samples):
        s = skill_sample(seed, "val", i)
        images = tuple(draw_skill_scene(scene, image_size) for scene in s.scenes)
        out.append(SkillEvalRecord(f"skills-val-{i}", images, s.question, s.answer, s.skill))
    return out
