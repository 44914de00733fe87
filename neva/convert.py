"""``python -m neva.convert``: HF ↔ neva checkpoint conversion.

::

    # llava-hf (current or legacy layout, safetensors or .bin) → neva
    python -m neva.convert hf-to-neva --hf llava-1.5-7b-hf --out ckpt/llava7b
    python -m neva.convert hf-to-neva --hf Qwen2.5-VL-7B-Instruct --out ckpt/qwen25vl7b
    # LLaVA's own layout (llava_llama / llava_mistral / llava_qwen config.json; --vision: the local tower directory
    # when mm_vision_tower names a Hub id; --llm: the decoder of a pretrain stage's config.json + mm_projector.bin)
    python -m neva.convert hf-to-neva --hf llava-v1.5-7b --vision clip-vit-large-patch14-336 --out ckpt/llava7b
    # new model from an HF Llama + an HF CLIP (projector freshly initialised; <image> added to the tokenizer)
    python -m neva.convert hf-to-neva --llm Llama-2-7b-chat-hf --vision clip-vit-large-patch14-336 --out ckpt/neva7b
    # neva → llava-hf (loads in LlavaForConditionalGeneration / AutoProcessor under transformers 4.4x and 5.x, with
    # the chat template the run trained with; see docs/INTEROP.md); --ckpt may also be any step checkpoint of a run
    # (a one-process .ckpt file or a DCP directory; LoRA merged, config read from it)
    python -m neva.convert neva-to-hf --ckpt ckpt/llava7b --out llava7b-hf
    python -m neva.convert neva-to-hf --ckpt runs/ft/checkpoints/step=500.ckpt --out ft-step500-hf
    # a run's step checkpoint → neva checkpoint (what neva.generate, neva.evaluate and restore_from_path read)
    python -m neva.convert neva-to-neva --ckpt runs/ft/checkpoints/last.ckpt --out ckpt/ft-last
    # LLaVA's released LoRA layout (adapter_config.json, non_lora_trainables.bin) + its model_base → neva, merged
    python -m neva.convert hf-to-neva --hf llava-v1.5-7b-lora --base vicuna-7b-v1.5 --vision clip-vit-large-patch14-336 --out ckpt/l
    # neva → LLaVA's own layout (config.json with mm_* keys, weights, tokenizer, the tower in vision_tower/);
    # --projector-only: LLaVA's pretrain output (config.json + mm_projector.bin)
    python -m neva.convert neva-to-llava --ckpt ckpt/llava7b --out llava-v1.5-7b-neva
    # a LoRA run's step checkpoint → llava-hf base (LoRA not merged) + PEFT adapter (PeftModel.from_pretrained)
    python -m neva.convert neva-to-hf --ckpt runs/ft/checkpoints/last.ckpt --out ft-base-hf --peft-adapter ft-lora
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import torch

from neva.checkpoint.hf_assemble import import_llm_and_vision
from neva.checkpoint.hf_read import load_hf_config
from neva.checkpoint.interop import interop_for, interop_for_hf
from neva.checkpoint.llava_original import import_llava_original, read_llava_config
from neva.checkpoint.neva_format import is_neva_checkpoint, load_config, refuse_nemo_checkpoint
from neva.checkpoint.safetensors_io import DEFAULT_MAX_SHARD_BYTES
from neva.checkpoint.step import as_neva_checkpoint, export_peft, is_step_checkpoint, materialize
from neva.errors import ConfigError, entry_point
from neva.hf_local import model_dir

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
    imp.add_argument(
        "--hf", help="llava-hf or Qwen2-VL / Qwen2.5-VL directory, or a LLaVA-original one (llava_llama config.json)"
    )
    imp.add_argument("--llm", help="HF Llama directory (with --vision; with --hf: a LLaVA pretrain output's decoder)")
    imp.add_argument(
        "--vision", help="HF CLIP or SigLIP directory (vision model or whole model; with --llm; with --hf: the tower)"
    )
    imp.add_argument(
        "--base", help="with --hf a LLaVA LoRA checkpoint (adapter_config.json): LLaVA's model_base, merged into"
    )
    imp.add_argument("--vision-select-layer", type=_select_layer, default=-2, help="e.g. -2, or -2,-5 to concat")
    imp.add_argument("--vision-select-feature", choices=("patch", "cls_patch"), default="patch")
    imp.add_argument("--projector-type", default="mlp2x_gelu", help="linear, identity, mlp<N>x_gelu or mlp_downsample")
    imp.add_argument("--pad-vocab-multiple", type=int, default=1, help="round the grown vocab up (llava-hf: 64)")
    imp.add_argument("--seed", type=int, default=0, help="projector initialisation seed")
    imp.add_argument("--image-aspect-ratio", choices=("square", "pad", "keep"), help="stored as inference default")
    imp.add_argument(
        "--conv-template",
        help="stored as the default template of neva.generate (default: the one a neva export's chat template records)",
    )
    imp.add_argument("--dtype", choices=sorted(DTYPES), help="cast weights (default: keep)")
    exp = sub.add_parser(
        "neva-to-hf", help="neva checkpoint (or a run's step checkpoint) → llava-hf (or Qwen-VL) directory"
    )
    exp.add_argument("--ckpt", required=True, help="neva checkpoint directory, or a step checkpoint (.ckpt / DCP dir)")
    exp.add_argument(
        "--conv-template", help="chat template to export (default: the one the checkpoint was trained with)"
    )
    exp.add_argument(
        "--dtype", choices=sorted(DTYPES), help="cast weights (default: the run's half precision, else keep)"
    )
    exp.add_argument(
        "--peft-adapter",
        metavar="DIR",
        help="LoRA step checkpoint only: write the LoRA as a PEFT adapter in DIR, and the base (LoRA not merged) to --out",
    )
    llava = sub.add_parser(
        "neva-to-llava", help="neva checkpoint (or a run's step checkpoint) → LLaVA's own layout (llava_llama)"
    )
    llava.add_argument("--ckpt", required=True, help="neva checkpoint directory, or a step checkpoint")
    llava.add_argument(
        "--projector-only", action="store_true", help="LLaVA's pretrain output: config.json + mm_projector.bin"
    )
    llava.add_argument(
        "--lora-base",
        metavar="DIR",
        help="LoRA step checkpoint only: LLaVA's LoRA layout (adapter + non_lora_trainables.bin) in --out, its "
        "model_base (the decoder, a plain HF model) in DIR",
    )
    llava.add_argument("--dtype", choices=sorted(DTYPES), help="cast weights (default: keep)")
    step = sub.add_parser("neva-to-neva", help="a run's step checkpoint (.ckpt file or DCP dir) → neva checkpoint")
    step.add_argument("--ckpt", required=True, help="<exp_dir>/checkpoints/step=N.ckpt or last.ckpt")
    step.add_argument("--dtype", choices=sorted(DTYPES), help="cast weights (default: keep)")
    for sp in (imp, exp, llava, step):
        sp.add_argument("--out", required=True, help="output directory (created atomically)")
        sp.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
        sp.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    if args.command == "hf-to-neva" and args.hf is None and (args.llm is None or args.vision is None):
        p.error("give either --hf, or both --llm and --vision")
    return args


@entry_point
def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: run one conversion and print ``{"command", "out"}`` as JSON."""
    args = parse_args(argv)
    for option in ("ckpt", "hf", "llm", "vision"):
        if getattr(args, option, None) is not None:
            refuse_nemo_checkpoint(getattr(args, option), f"--{option}")
    _convert(args)


def _convert(args: argparse.Namespace) -> None:
    common = dict(dtype=DTYPES.get(args.dtype), max_shard_bytes=args.max_shard_bytes, overwrite=args.overwrite)
    if args.command == "neva-to-hf" and args.peft_adapter:
        if not is_step_checkpoint(args.ckpt) or is_neva_checkpoint(args.ckpt):
            raise ConfigError(
                f"--peft-adapter needs a LoRA run's step checkpoint (its `final` holds merged weights): {args.ckpt}"
            )
        out, adapter = export_peft(args.ckpt, args.out, args.peft_adapter, **common)
        print(json.dumps({"command": args.command, "out": str(out), "peft_adapter": str(adapter)}))
        return
    if args.command == "neva-to-hf":
        with as_neva_checkpoint(args.ckpt) as ckpt:
            out = interop_for(load_config(ckpt)).export(ckpt, args.out, conv_template=args.conv_template, **common)
    elif args.command == "neva-to-llava" and args.lora_base:
        from neva.checkpoint.llava_export import export_llava_lora

        if not is_step_checkpoint(args.ckpt) or is_neva_checkpoint(args.ckpt):
            raise ConfigError(f"--lora-base needs a LoRA run's step checkpoint (its `final` is merged): {args.ckpt}")
        out, base = export_llava_lora(args.ckpt, args.out, args.lora_base, **common)
        print(json.dumps({"command": args.command, "out": str(out), "lora_base": str(base)}))
        return
    elif args.command == "neva-to-llava":
        from neva.checkpoint.llava_export import export_llava_original

        with as_neva_checkpoint(args.ckpt) as ckpt:
            out = export_llava_original(ckpt, args.out, projector_only=args.projector_only, **common)
    elif args.command == "neva-to-neva":
        if not is_step_checkpoint(args.ckpt) or is_neva_checkpoint(args.ckpt):
            raise ConfigError(
                f"--ckpt {args.ckpt} is not a step checkpoint (a .ckpt file or a DCP directory with meta.pt)"
            )
        out = materialize(args.ckpt, args.out, dtype=common["dtype"], overwrite=args.overwrite)
    else:
        meta = {
            k: v
            for k, v in (("image_aspect_ratio", args.image_aspect_ratio), ("conv_template", args.conv_template))
            if v
        }
        if args.hf is not None and read_llava_config(model_dir(args.hf)) is not None:
            # LLaVA's own layout: --vision overrides mm_vision_tower, --llm gives a pretrain output's decoder.
            out = import_llava_original(
                args.hf, args.out, vision=args.vision, llm=args.llm, base=args.base, metadata=meta, **common
            )
        elif args.hf is not None:
            if args.llm is not None or args.vision is not None or args.base is not None:
                raise ConfigError(
                    "--llm/--vision/--base go with --hf only for a LLaVA-original directory (llava_llama config.json)"
                )
            interop = interop_for_hf(load_hf_config(model_dir(args.hf)))
            out = interop.import_dir(args.hf, args.out, metadata=meta, **common)
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
