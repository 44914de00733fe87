"""Built-in synthetic data: coloured shapes on small images, captions and question–answer conversations.

Everything is a pure function of ``(seed, split, index)``: records are generated up front (cheap dicts) and images
are drawn on demand from their name, so no files are needed and DataLoader workers agree on every pixel.

An image is a 2×2 grid of cells; ``count`` cells hold the same shape in the same colour (slightly jittered), so every
question has one short answer readable from the image: colour, shape, count and, for a single shape, its position.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from neva.constants import IMAGE_TOKEN

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 210, 40),
}
SHAPES = ("circle", "square", "triangle")
COUNT_WORDS = ("zero", "one", "two", "three")
CELLS = ("top left", "top right", "bottom left", "bottom right")
SPLITS = {"train": 0, "val": 1}

QUESTIONS = {
    "color": ("What color is the shape?", "What color are the shapes?"),
    "shape": ("What shape is it?", "What shape are they?"),
    "count": ("How many shapes are there?", "How many shapes are there?"),
    "position": ("Where is the shape?", None),
}


@dataclass(frozen=True)
class ShapeScene:
    """What one synthetic image shows."""

    shape: str
    color: str
    count: int
    cells: tuple[int, ...]  # indices into CELLS
    background: int  # grey level
    jitter: tuple[tuple[int, int], ...]  # pixel offset per shape

    def answer(self, kind: str) -> str:
        """The one-or-two-word answer to a question of ``kind``."""
        if kind == "color":
            return self.color
        if kind == "shape":
            return self.shape
        if kind == "count":
            return COUNT_WORDS[self.count]
        if kind == "position":
            return CELLS[self.cells[0]]
        raise KeyError(kind)

    def question(self, kind: str) -> str:
        """The question text for ``kind`` (singular or plural wording)."""
        return QUESTIONS[kind][0 if self.count == 1 else 1]

    def kinds(self) -> list[str]:
        """Question kinds this scene answers unambiguously."""
        return ["color", "shape", "count", "position"] if self.count == 1 else ["color", "shape", "count"]

    def caption(self) -> str:
        """Pretraining caption, e.g. ``two red circles`` or ``one blue square at the top left``."""
        text = f"{COUNT_WORDS[self.count]} {self.color} {self.shape}{'s' if self.count > 1 else ''}"
        return f"{text} at the {CELLS[self.cells[0]]}" if self.count == 1 else text


def scene(seed: int, split: str, index: int) -> ShapeScene:
    """The scene of sample ``index`` of ``split`` (deterministic)."""
    rng = np.random.default_rng([seed, SPLITS[split], index])
    count = int(rng.integers(1, 4))
    cells = tuple(sorted(int(c) for c in rng.choice(4, size=count, replace=False)))
    return ShapeScene(
        shape=SHAPES[int(rng.integers(len(SHAPES)))],
        color=list(COLORS)[int(rng.integers(len(COLORS)))],
        count=count,
        cells=cells,
        background=int(rng.integers(0, 60)),
        jitter=tuple((int(rng.integers(-1, 2)), int(rng.integers(-1, 2))) for _ in cells),
    )


def draw_scene(s: ShapeScene, size: int) -> Image.Image:
    """Render a scene as an RGB image of ``size`` × ``size`` pixels."""
    img = Image.new("RGB", (size, size), (s.background,) * 3)
    draw = ImageDraw.Draw(img)
    half = size / 2
    margin = max(1.0, size / 16)
    for cell, (dx, dy) in zip(s.cells, s.jitter):
        x0 = (cell % 2) * half + margin + dx * size / 32
        y0 = (cell // 2) * half + margin + dy * size / 32
        draw_shape(draw, s.shape, s.color, (x0, y0, x0 + half - 2 * margin, y0 + half - 2 * margin))
    return img


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, color: str, box: tuple[float, float, float, float]) -> None:
    """Draw one filled ``shape`` of ``color`` (names from ``SHAPES`` / ``COLORS``) inside ``box`` (x0, y0, x1, y1)."""
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=COLORS[color])
    elif shape == "square":
        draw.rectangle(box, fill=COLORS[color])
    else:
        draw.polygon(((x0 + x1) / 2, y0, x1, y1, x0, y1), fill=COLORS[color])


def image_name(split: str, index: int) -> str:
    """Name of a synthetic image in records (resolved by ``SyntheticImages``)."""
    return f"{split}/{index:06d}.png"


class SyntheticImages:
    """Picklable name → image function for ``CallableImageSource``."""

    def __init__(self, seed: int, image_size: int) -> None:
        self.seed = seed
        self.image_size = image_size

    def __call__(self, name: str) -> Image.Image:
        split, _, file = name.partition("/")
        if split not in SPLITS or not file.endswith(".png"):
            raise KeyError(name)
        return draw_scene(scene(self.seed, split, int(file[: -len(".png")])), self.image_size)


def make_record(seed: int, split: str, index: int, task: str) -> dict[str, Any]:
    """LLaVA-format record of sample ``index``: a caption (``task="caption"``) or multi-turn QA (``"qa"``)."""
    s = scene(seed, split, index)
    rid = f"synthetic-{split}-{index}"
    if task == "caption":
        conv = [
            {"from": "human", "value": f"{IMAGE_TOKEN}\nDescribe the image."},
            {"from": "gpt", "value": s.caption()},
        ]
        return {"id": rid, "image": image_name(split, index), "conversations": conv}
    rng = np.random.default_rng([seed, SPLITS[split], index, 1])
    kinds = [s.kinds()[int(i)] for i in rng.permutation(len(s.kinds()))]
    conv = []
    for turn, kind in enumerate(kinds):
        question = s.question(kind)
        conv.append({"from": "human", "value": f"{IMAGE_TOKEN}\n{question}" if turn == 0 else question})
        conv.append({"from": "gpt", "value": s.answer(kind)})
    return {"id": rid, "image": image_name(split, index), "conversations": conv}


def synthetic_records(seed: int, split: str, num_samples: int, task: str) -> list[dict[str, Any]]:
    """``num_samples`` records of ``split`` (``train`` or the held-out ``val``)."""
    return [make_record(seed, split, i, task) for i in range(num_samples)]


@dataclass(frozen=True)
class EvalRecord:
    """One evaluation question with its exact expected answer."""

    id: str
    image: Image.Image
    question: str
    answer: str
    kind: str


def synthetic_eval_records(image_size: int, seed: int = 0, num_samples: int = 200) -> list[EvalRecord]:
    """Held-out (``val`` split) single questions for exact-answer accuracy, question kinds in rotation.

    The question text is the bare question; the evaluator prepends ``<image>\\n`` and renders it with the template
    it trained with (``Template.render_prompt``), then compares the greedy answer with ``answer``.
    """
    out = []
    for i in range(num_samples):
        s = scene(seed, "val", i)
        kinds = s.kinds()
        kind = kinds[i % len(kinds)]
        out.append(EvalRecord(f"synthetic-val-{i}", draw_scene(s, image_size), s.question(kind), s.answer(kind), kind))
    return out


def _tokenizer_corpus() -> list[str]:
    from neva.data.templates.generic import LLAMA_2_SYSTEM, VICUNA_SYSTEM

    lines = [VICUNA_SYSTEM, LLAMA_2_SYSTEM, "Describe the image."]
    lines += ["USER: ASSISTANT: [INST] [/INST] <<SYS>> <</SYS>>"] * 20
    lines += ["<|start_header_id|>user<|end_header_id|> <|eot_id|> <|im_start|>assistant <|im_end|> system"] * 5
    for shape in SHAPES:
        for color in COLORS:
            for count in (1, 2, 3):
                for cell in range(4):
                    s = ShapeScene(shape, color, count, (cell,), 0, ((0, 0),))
                    lines.append(s.caption())
                    lines += [f"{s.question(k)} {s.answer(k)}" for k in s.kinds()]
    return lines


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)])
    return tok.to_str()


TOKENIZER_VOCAB_SIZE = 400
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN]


def build_tokenizer() -> Any:
    """Small deterministic byte-level BPE tokenizer for the synthetic set (built in code, no download).

    Ids: ``<unk>`` 0, ``<s>`` 1 (added as BOS), ``</s>`` 2, ``<pad>`` 3, ``<image>`` 4; vocabulary 400 (< 512, the
    tiny LLM's). Byte-level, so any text encodes; every synthetic answer word is a single token.

    Returns:
        A ``PreTrainedTokenizerFast``; ``save_pretrained(dir)`` makes a directory ``AutoTokenizer`` loads.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=[IMAGE_TOKEN],
    )
