"""``python -m neva.generate``: answer prompts about images with a neva checkpoint.

Single prompt (prints only the generated text)::

    python -m neva.generate --checkpoint CKPT --image cat.png --prompt "What is this?" --max-new-tokens 64
    python -m neva.generate --checkpoint CKPT --video clip.mp4 --prompt "Which way does it move?"

Batch (NeMo NeVA's record format; ``image`` is a path or a list, relative to the JSONL's folder, ``video`` too, decoded
as ``--video`` decodes; each record is written back with an ``"answer"``)::

    python -m neva.generate --checkpoint CKPT --input-file prompts.jsonl --output-file answers.jsonl

A record that cannot be answered (a line that is not a JSON object, no ``prompt``, an unreadable image, a video the
training loader would skip (its reason: ``corrupt_video``...), ``<image>`` / ``<video>`` tags that do not match, a
prompt that fills the model's context) is written back with an ``"error"`` instead, the others are answered, and the
command then exits with status 1, naming how many failed.

Prompts: by default the prompt is the user turn of a conversation template (``--template``, default the checkpoint's
``conv_template`` metadata, else ``vicuna_v1``), rendered up to the assistant cue; ``<image>\\n`` is put in front for
each image when the prompt has no ``<image>``. With ``--raw`` the prompt is used as given and tokenized exactly as
the family's HF processor does for an exported checkpoint: ``LlavaProcessor`` (each ``<image>`` becomes that image's
tokens, BOS added), or for a Qwen-VL checkpoint Qwen's processor (each ``<image>`` written as Qwen's vision block
``<|vision_start|><|image_pad|><|vision_end|>``, which a prompt may also hold as it is, the pad expanded to the image's
positions; ``neva.data.raw_prompts``).

Decoding: greedy by default. ``--sample`` samples with NeMo NeVA's inference defaults (temperature 0.2, top-p 0.9,
top-k 0, repetition penalty 1.2); giving ``--temperature``/``--top-p``/``--top-k`` implies ``--sample``. Generation
stops at EOS, at the template's end-of-turn text, at a ``--stop`` string (cut from the printed text), or when prompt and
answer fill the model's context (a larger ``--max-new-tokens`` is capped there, with a warning).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint.neva_format import refuse_nemo_checkpoint
from neva.data.records import record_videos
from neva.data.templates.registry import TEMPLATE_CLASSES
from neva.data.video_decode import VideoError
from neva.errors import InputError, entry_point
from neva.inference import Answerer, Item, read_jsonl, record_image_paths
from neva.models.generation import GenerationConfig

NEMO_SAMPLING = dict(temperature=0.2, top_p=0.9, top_k=0, repetition_penalty=1.2)


def decoding(args: argparse.Namespace) -> GenerationConfig:
    """Decoding settings from the command line (see the module docstring for the defaults)."""
    sample = not args.greedy and (args.sample or any(v is not None for v in (args.temperature, args.top_p, args.top_k)))
    defaults = NEMO_SAMPLING if sample else dict(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
    pick = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    return GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=sample, stop_strings=tuple(args.stop), **pick)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (``--help`` lists them)."""
    p = argparse.ArgumentParser(prog="python -m neva.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="neva checkpoint directory")
    p.add_argument("--image", action="append", default=[], help="image path (repeat for several)")
    p.add_argument(
        "--video",
        action="append",
        default=[],
        help="video path (repeat for several; <video> tags mark where they go; "
        "sampled to the checkpoint's num_frames by the loader's decoder)",
    )
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
    fmt.add_argument(
        "--template",
        help=f"conversation template ({', '.join(TEMPLATE_CLASSES)}; default: the one the checkpoint was trained with)",
    )
    fmt.add_argument(
        "--raw",
        action="store_true",
        help="use the prompt as given, tokenized as the family's HF processor does: <image> is LLaVA's <image>, or "
        "Qwen-VL's <|vision_start|><|image_pad|><|vision_end|> (which the prompt may hold as it is)",
    )
    p.add_argument("--system", help="system prompt (template mode; default: the one the checkpoint was trained with)")
    p.add_argument("--image-aspect-ratio", choices=("square", "pad", "keep"), help="default: checkpoint metadata")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if (args.prompt is None) == (args.input_file is None):
        p.error("give exactly one of --prompt and --input-file")
    if args.video and args.input_file is not None:
        p.error("--video goes with --prompt (batch records name their own 'video')")
    return args


@entry_point
def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: answer one prompt (printed) or a JSONL file of them."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    refuse_nemo_checkpoint(args.checkpoint, "--checkpoint")
    answerer = Answerer(
        args.checkpoint,
        decoding(args),
        template=args.template,
        raw=args.raw,
        system=args.system,
        aspect_ratio=args.image_aspect_ratio,
        device=args.device,
        dtype=None if args.dtype == "auto" else getattr(torch, args.dtype),
    )
    if args.prompt is not None:
        try:
            videos = [answerer.read_video(v) for v in args.video]
        except VideoError as err:
            raise InputError(f"--video {err}") from err
        print(answerer.answer([(args.prompt, [Path(p) for p in args.image], videos)])[0])
        return
    path = Path(args.input_file)
    records = read_jsonl(path, keep_going=True)
    items = (record_item(r, path.parent, answerer.read_video) for r in records)
    failed = 0
    out = open(args.output_file, "w") if args.output_file else sys.stdout  # noqa: SIM115 - stdout is not closed
    try:
        for record, result in zip(records, answerer.answer_all(items, args.batch_size, keep_going=True)):
            row = record if isinstance(record, dict) else {} if isinstance(record, Exception) else {"record": record}
            if isinstance(result, Exception):
                failed += 1
                row = {**row, "error": str(result)}
            else:
                row = {**row, "answer": result}
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            out.flush()
    finally:
        if out is not sys.stdout:
            out.close()
    if failed:
        print(f"neva.generate: {failed} of {len(records)} records not answered (see their 'error')", file=sys.stderr)
        sys.exit(1)


def record_item(record: Any, root: Path, read_video: Callable[[Path], Any]) -> Item | Exception:
    """A record's ``(prompt, image paths, videos)`` (each video decoded by ``read_video``), or the error that makes it
    unanswerable."""
    if isinstance(record, Exception):
        return record
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        return ValueError("the record has no 'prompt' string")
    try:
        images = record_image_paths(record, root)
        videos = [root / name for name in record_videos(record)]
    except TypeError as err:
        return ValueError(f"the record's 'image' or 'video' is not a path or a list of paths ({err})")
    try:
        return record["prompt"], images, [read_video(v) for v in videos]
    except VideoError as err:
        return ValueError(f"video {err}")


if __name__ == "__main__":
    main()
