"""``python -m neva.convert``: HF ↔ neva checkpoint conversion.

::

    # llava-hf (current or legacy layout, safetensors or .bin) → neva
    python -m neva.convert hf-to-neva --hf llava-1.5-7b-hf --out ckpt/llava7b
    # new model from an HF Llama + an HF CLIP (projector freshly initialised; <image> added to the tokenizer)
    python -m neva.convert hf-to-neva --llm Llama-2-7b-chat-hf --vision clip-vit-large-patch14-336 --out ckpt/neva7b
    # neva → llava-hf (loads in LlavaForConditionalGeneration / AutoProcessor under transformers 4.4x and 5.x, with
    # the chat template the run trained with; see docs/INTEROP.md)
    python -m neva.convert neva-to-hf --ckpt ckpt/llava7b --out llava7b-hf
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import torch

from neva.checkpoint.hf import export_llava, import_llava, import_llm_and_vision
from neva.checkpoint.safetensors_io import DEFAULT_MAX_SHARD_BYTES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _select_layer(text: str) -> int | list[int]:
    # "-2" or "-2,-5" (several layers concatenated, HF's list-valued vision_feature_layer)
    layers = [int(x) for x in text.split(",")]
    return layers[0] if len(layers) == 1 else layers


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (``--help`` lists them)."""
    p = argparse.ArgumentParser(prog="python -m neva.convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("hf-to-neva", help="HF llava-hf dir, or HF Llama + HF CLIP dirs → neva checkpoint")
    imp.add_argument("--hf", help="llava-hf directory")
    imp.add_argument("--llm", help="HF Llama directory (with --vision)")
    imp.add_argument("--vision", help="HF CLIPVisionModel or CLIPModel directory (with --llm)")
    imp.add_argument("--vision-select-layer", type=_select_layer, default=-2, help="e.g. -2, or -2,-5 to concat")
    imp.add_argument("--vision-select-feature", choices=("patch", "cls_patch"), default="patch")
    imp.add_argument("--projector-type", default="mlp2x_gelu", help="linear, identity or mlp<N>x_gelu")
    imp.add_argument("--pad-vocab-multiple", type=int, default=1, help="round the grown vocab up (llava-hf: 64)")
    imp.add_argument("--seed", type=int, default=0, help="projector initialisation seed")
    imp.add_argument("--image-aspect-ratio", choices=("square", "pad", "keep"), help="stored as inference default")
    imp.add_argument(
        "--conv-template",
        help="stored as the default template of neva.generate (default: the one a neva export's chat template records)",
    )
    exp = sub.add_parser("neva-to-hf", help="neva checkpoint → llava-hf directory")
    exp.add_argument("--ckpt", required=True, help="neva checkpoint directory")
    exp.add_argument(
        "--conv-template", help="chat template to export (default: the one the checkpoint was trained with)"
    )
    exp.add_argument(
        "--dtype", choices=sorted(DTYPES), help="cast weights (default: the run's half precision, else keep)"
    )
    imp.add_argument("--dtype", choices=sorted(DTYPES), help="cast weights (default: keep)")
    for sp in (imp, exp):
        sp.add_argument("--out", required=True, help="output directory (created atomically)")
        sp.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
        sp.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    if args.command == "hf-to-neva" and (args.hf is None) == (args.llm is None or args.vision is None):
        p.error("give either --hf, or both --llm and --vision")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: run one conversion and print ``{"command", "out"}`` as JSON."""
    args = parse_args(argv)
    common = dict(dtype=DTYPES.get(args.dtype), max_shard_bytes=args.max_shard_bytes, overwrite=args.overwrite)
    if args.command == "neva-to-hf":
        out = export_llava(args.ckpt, args.out, conv_template=args.conv_template, **common)
    else:
        meta = {
            k: v
            for k, v in (("image_aspect_ratio", args.image_aspect_ratio), ("conv_template", args.conv_template))
            if v
        }
        if args.hf is not None:
            out = import_llava(args.hf, args.out, metadata=meta, **common)
        else:
            out = import_llm_and_vision(
                args.llm,
                args.vision,
                args.out,
                vision_select_layer=args.vision_select_layer,
                vision_select_feature=args.vision_select_feature,
                projector_type=args.projector_type,
                pad_vocab_multiple=args.pad_vocab_multiple,
                seed=args.seed,
                metadata=meta,
                **common,
            )
    print(json.dumps({"command": args.command, "out": str(out)}))


if __name__ == "__main__":
    main()
