"""``python -m neva.generate``: answer prompts about images with a neva checkpoint.

Single prompt (prints only the generated text)::

    python -m neva.generate --checkpoint CKPT --image cat.png --prompt "What is this?" --max-new-tokens 64

Batch (NeMo NeVA's record format; ``image`` is a path or a list, relative to the JSONL's folder; each record is
written back with an ``"answer"``)::

    python -m neva.generate --checkpoint CKPT --input-file prompts.jsonl --output-file answers.jsonl

Prompts: by default the prompt is the user turn of a conversation template (``--template``, default the checkpoint's
``conv_template`` metadata, else ``vicuna_v1``), rendered up to the assistant cue; ``<image>\\n`` is put in front for
each image when the prompt has no ``<image>``. With ``--raw`` the prompt is used as given and tokenized exactly as
HF's ``LlavaProcessor`` does for an exported checkpoint (each ``<image>`` becomes that image's tokens, BOS added).

Decoding: greedy by default. ``--sample`` samples with NeMo NeVA's inference defaults (temperature 0.2, top-p 0.9,
top-k 0, repetition penalty 1.2); giving ``--temperature``/``--top-p``/``--top-k`` implies ``--sample``. Generation
stops at EOS, at the template's end-of-turn text, or at a ``--stop`` string (cut from the printed text).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from neva.checkpoint.neva_format import load_metadata, load_model, load_tokenizer
from neva.constants import IMAGE_TOKEN
from neva.models.config import NevaConfig
from neva.models.generation import GenerationConfig, generate

NEMO_SAMPLING = dict(temperature=0.2, top_p=0.9, top_k=0, repetition_penalty=1.2)
DEFAULT_TEMPLATE = "vicuna_v1"


class PromptBuilder:
    """Turns a user prompt + its images into token ids (image positions expanded) for one checkpoint."""

    def __init__(self, tokenizer: Any, cfg: NevaConfig, template: str | None, system: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.system = system
        self.template = None
        if template is not None:
            from neva.data.conversation import get_template

            self.template = get_template(template, tokenizer)

    def ids(self, prompt: str, num_images: int) -> list[int]:
        """Token ids of the full model input.

        Raises:
            ValueError: the number of ``<image>`` tags differs from the number of images.
        """
        per_image = self.cfg.num_image_tokens
        if self.template is None:
            self._check_tags(prompt, num_images)
            # LlavaProcessor: expand the text, then one tokenizer call with special tokens (BOS).
            return list(self.tokenizer(prompt.replace(IMAGE_TOKEN, IMAGE_TOKEN * per_image)).input_ids)
        from neva.data.conversation import ChatTemplateRenderer, Message

        if num_images and IMAGE_TOKEN not in prompt:
            prompt = (IMAGE_TOKEN + "\n") * num_images + prompt
        self._check_tags(prompt, num_images)
        text = self.template.render_prompt([Message("user", prompt)], system_prompt=self.system)
        # Same tokenization as training (neva.data.encoding): one call on the rendered text, then expand images.
        add_special = not isinstance(self.template, ChatTemplateRenderer)
        out: list[int] = []
        for tok in self.tokenizer(text, add_special_tokens=add_special).input_ids:
            out += [tok] * per_image if tok == self.cfg.image_token_id else [tok]
        return out

    @staticmethod
    def _check_tags(prompt: str, num_images: int) -> None:
        tags = prompt.count(IMAGE_TOKEN)
        if tags != num_images:
            raise ValueError(f"prompt has {tags} {IMAGE_TOKEN} tag(s) but {num_images} image(s) were given")

    def stop_strings(self) -> tuple[str, ...]:
        """The template's end-of-turn text (e.g. ``<|im_end|>``, plain's newline)."""
        eot = getattr(self.template, "eot", "") if self.template is not None else ""
        return (eot.strip() or eot,) if eot else ()

    def eos_ids(self) -> tuple[int, ...]:
        """EOS, plus the end-of-turn token when the template's end-of-turn text is one token."""
        ids = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        for stop in self.stop_strings():
            tok = self.tokenizer.get_vocab().get(stop)
            if tok is not None and tok not in ids:
                ids.append(tok)
        return tuple(ids)


def load_pixels(paths: Sequence[Path], cfg: NevaConfig, aspect_ratio: str) -> torch.Tensor | None:
    """Images → ``[N, 3, H, W]`` with neva's CLIP preprocessing (identical to HF ``CLIPImageProcessor``)."""
    if not paths:
        return None
    if cfg.vision is None:
        raise ValueError("this checkpoint has no vision tower; drop the images")
    from neva.data.images import ImageProcessor

    process = ImageProcessor(cfg.vision, aspect_ratio)
    tensors = []
    for path in paths:
        with Image.open(path) as image:
            tensors.append(process(image))
    return torch.stack(tensors)


def decode_answer(tokenizer: Any, ids: list[int], stops: Sequence[str]) -> str:
    """Generated ids → text without special tokens, cut at the first stop string."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stops if s and s in text]
    return text[: min(cuts)] if cuts else text


def generation_config(args: argparse.Namespace, builder: PromptBuilder) -> GenerationConfig:
    """Decoding settings from the command line (see the module docstring for the defaults)."""
    sample = not args.greedy and (args.sample or any(v is not None for v in (args.temperature, args.top_p, args.top_k)))
    defaults = NEMO_SAMPLING if sample else dict(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
    pick = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    pad = builder.tokenizer.pad_token_id
    if pad is None or pad == builder.cfg.image_token_id:
        pad = 0
    return GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        do_sample=sample,
        eos_token_ids=builder.eos_ids(),
        stop_strings=builder.stop_strings() + tuple(args.stop),
        pad_token_id=pad,
        **pick,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (``--help`` lists them)."""
    p = argparse.ArgumentParser(prog="python -m neva.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="neva checkpoint directory")
    p.add_argument("--image", action="append", default=[], help="image path (repeat for several)")
    p.add_argument("--prompt", help="user prompt; <image> tags mark where images go")
    p.add_argument("--input-file", help="JSONL of {'image': ..., 'prompt': ...} records (batch mode)")
    p.add_argument("--output-file", help="JSONL answers (batch mode); default stdout")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--greedy", action="store_true", help="greedy decoding (the default)")
    p.add_argument("--sample", action="store_true", help="sample with NeMo's defaults")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--template", help="conversation template (plain, vicuna_v1, llama_2, mistral, llama_3, chatml)")
    fmt.add_argument("--raw", action="store_true", help="use the prompt as given (HF LlavaProcessor tokenization)")
    p.add_argument("--system", help="system prompt (template mode)")
    p.add_argument("--image-aspect-ratio", choices=("square", "pad", "keep"), help="default: checkpoint metadata")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if (args.prompt is None) == (args.input_file is None):
        p.error("give exactly one of --prompt and --input-file")
    return args


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSONL file's records (blank lines skipped)."""
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            records.append(json.loads(line))
    return records


def record_images(record: dict[str, Any], root: Path) -> list[Path]:
    """A record's image paths (``image``: one path, a list, or absent), relative to ``root``."""
    images = record.get("image") or []
    return [root / p for p in ([images] if isinstance(images, str) else images)]


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: answer one prompt (printed) or a JSONL file of them."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    ckpt = Path(args.checkpoint)
    meta = load_metadata(ckpt)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    model = load_model(ckpt, device=args.device, dtype=dtype)
    tokenizer = load_tokenizer(ckpt)
    template = None if args.raw else (args.template or meta.get("conv_template") or DEFAULT_TEMPLATE)
    builder = PromptBuilder(tokenizer, model.cfg, template, args.system)
    gen_cfg = generation_config(args, builder)
    aspect = args.image_aspect_ratio or meta.get("image_aspect_ratio", "square")

    def answer(items: list[tuple[str, list[Path]]]) -> list[str]:
        prompts = [builder.ids(prompt, len(images)) for prompt, images in items]
        pixels = load_pixels([p for _, images in items for p in images], model.cfg, aspect)
        counts = [len(images) for _, images in items]
        outs = generate(model, prompts, pixels, counts, gen_cfg, decode=lambda ids: tokenizer.decode(ids))
        return [decode_answer(tokenizer, ids, gen_cfg.stop_strings) for ids in outs]

    if args.prompt is not None:
        print(answer([(args.prompt, [Path(p) for p in args.image])])[0])
        return
    path = Path(args.input_file)
    records = read_records(path)
    out = open(args.output_file, "w") if args.output_file else sys.stdout  # noqa: SIM115 - stdout is not closed
    try:
        for start in range(0, len(records), args.batch_size):
            chunk = records[start : start + args.batch_size]
            answers = answer([(r["prompt"], record_images(r, path.parent)) for r in chunk])
            for record, text in zip(chunk, answers):
                out.write(json.dumps({**record, "answer": text}, ensure_ascii=False) + "\n")
            out.flush()
    finally:
        if out is not sys.stdout:
            out.close()


if __name__ == "__main__":
    main()
