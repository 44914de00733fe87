"""``python -m neva.data.preview``: see exactly what the model will be trained on.

Without ``--json``: each sample's rendered prompt with the learned spans highlighted. With ``--json``: one object per
line, ``{"id", "input_ids", "labels"}`` (aligned; -100 = not learned; image positions expanded to the image token id)
or ``{"id", "skipped": reason}``. With an AnyRes checkpoint as ``--tokenizer`` (``--image-folder`` required), each
image's size, tile grid, tiles and decoder positions too (``"images"``). A record's videos: frames sampled (their
indices and the stream's frame count with ``--video-folder``), decoder positions (``"videos"``); a video that cannot
be used is the record's skip reason, as in training. A preference record (the DPO stage's ``prompt`` / ``chosen`` /
``rejected``) shows as its two samples, ``<id> chosen`` and ``<id> rejected``, each learning its final reply only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np
import torch

from neva.data.config import SYNTHETIC, TEMPLATES
from neva.data.conversation import count_image_tags, parse_conversations, place_image_tags
from neva.data.dataset import EncoderSettings, encode_media_record
from neva.data.encoding import TOKENIZATIONS
from neva.data.errors import SampleError
from neva.data.images import image_source_for
from neva.data.preference import last_reply_only, pair_conversations
from neva.data.records import load_records, record_images, record_videos
from neva.data.video import VIDEO, VideoSource, check_video_model, load_videos, tag_spans
from neva.data.video_decode import VideoLimits
from neva.data.visual_budget import VisualBudget
from neva.errors import ConfigError, entry_point

_GREEN, _RESET = "\033[32m", "\033[0m"


def load_tokenizer(path: str) -> Any:
    """``AutoTokenizer`` from a directory (a neva checkpoint has the tokenizer files at its top level), or the
    built-in synthetic tokenizer for ``synthetic``. An HF LLM's own tokenizer has no ``<image>``: it gets the tokens
    training adds to it (``add_vision_tokens``, as ``model.mm_cfg.llm.from_pretrained`` runs do), so the preview's
    ids are the run's; a note on stderr says so."""
    if path == SYNTHETIC:
        from neva.data.synthetic import build_tokenizer

        return build_tokenizer()
    from neva.constants import IMAGE_TOKEN
    from neva.data.sentencepiece_tokenizer import load_tokenizer as load_hf_tokenizer
    from neva.data.tokens import add_vision_tokens

    tokenizer = load_hf_tokenizer(path)
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        add_vision_tokens(tokenizer)
        print(f"note: {path} has no {IMAGE_TOKEN} token; added as training adds it to an HF LLM's tokenizer "
              f"(id {tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)})", file=sys.stderr)  # fmt: skip
    return tokenizer


def checkpoint_config(path: str) -> Any:
    """The ``NevaConfig`` of a neva checkpoint's ``config.json`` (``model`` key), else None."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        return None
    try:
        with open(cfg_path) as f:
            data = json.load(f)
    except json.JSONDecodeError as err:  # the user's file: one line naming it (neva.errors)
        raise ConfigError(f"{cfg_path}: not JSON ({err})") from err
    if not isinstance(data, dict) or "model" not in data:
        return None
    from neva.models.config import NevaConfig, from_dict

    return from_dict(NevaConfig, data["model"])


def anyres_images(record: dict[str, Any], source: Any, cfg: Any) -> list[dict[str, Any]]:
    """Per image of an AnyRes model: its size, grid, tiles and decoder positions (``neva.models.anyres``).

    Raises:
        SampleError: an image that cannot be loaded.
    """
    from neva.data.images import safe_relative_path
    from neva.models.anyres import feature_index, grid_shape

    out = []
    for name in record_images(record):
        w, h = source.load(safe_relative_path(name)).size
        lay = feature_index(cfg.anyres, cfg.num_image_tokens, cfg.vision.image_size, (h, w))
        grid = grid_shape((h, w), cfg.anyres.grid_pinpoints, cfg.vision.image_size)
        out.append({"name": name, "size": [h, w], "grid": list(grid), "tiles": lay.tiles, "tokens": lay.tokens})
    return out


def native_images(record: dict[str, Any], source: Any, spec: Any) -> list[dict[str, Any]]:
    """Per image of a native-resolution model (Qwen-VL): its size, the size the pixel budget resizes it to, its patch
    grid and its decoder positions (t·h·w / merge², ``neva.data.qwen_images``), as training counts them.

    Raises:
        SampleError: an image that cannot be loaded.
    """
    from neva.data.images import safe_relative_path
    from neva.data.qwen_images import image_grid, image_token_count, resized_size

    out = []
    for name in record_images(record):
        w, h = source.load(safe_relative_path(name)).size
        _, gh, gw = image_grid(spec, h, w)
        out.append({"name": name, "size": [h, w], "resized": list(resized_size(spec, h, w)), "grid": [gh, gw],
                    "tokens": image_token_count(spec, h, w)})  # fmt: skip
    return out


def native_spec(path: str, cfg: Any) -> Any:
    """A native-resolution checkpoint's image spec at the pixel budget it records (None for any other model)."""
    if cfg is None or cfg.vision is None or not cfg.vision.spec.patch_grid:
        return None
    if cfg.vision.spec.native_sizes is not None:  # sized by its own rule, which this preview does not show yet
        raise ConfigError(f"{path}: previewing a {cfg.vision.kind} checkpoint's images is not implemented yet")
    from neva.data.qwen_images import QwenImageSpec

    with open(os.path.join(path, "config.json")) as f:
        meta = json.load(f)
    return QwenImageSpec.for_tower(cfg.vision, meta.get("min_pixels"), meta.get("max_pixels"))


def refuse_hf_native(path: str) -> None:
    """An HF directory whose processor sizes images natively (``min_pixels`` / ``max_pixels``: Qwen-VL) has no one
    count per image; counting ``--num-image-tokens`` for it would be wrong without a word.

    Raises:
        ConfigError: naming the directory and the way through.
    """
    pre = os.path.join(path, "preprocessor_config.json")
    if not os.path.isfile(pre):
        return
    with open(pre) as f:
        data = json.load(f)
    # Qwen2-VL's image processors: a merge size and the pixel budget (as min/max_pixels or the size's two edges)
    if "merge_size" in data and ("max_pixels" in data or "longest_edge" in (data.get("size") or {})):
        raise ConfigError(
            f"--tokenizer {path}: an HF native-resolution model (its processor resizes each image within min_pixels / "
            "max_pixels), whose images take as many positions as their size gives: import it (`python -m neva.convert "
            "hf-to-neva`) and pass that checkpoint with --image-folder"
        )


def video_rule(cfg: Any, grid: int) -> tuple[Any, int | None]:
    """Positions of one video of F frames and their id: the checkpoint's (``NevaConfig.video_tokens``), else
    LLaVA-NeXT-Video's pooling (``VideoConfig()``) of a ``grid`` × ``grid`` tower."""
    import functools

    from neva.models.video import VideoConfig, video_token_count

    if cfg is not None:
        return (cfg.video_tokens if cfg.video is not None else None), cfg.video_token_id
    return functools.partial(video_token_count, VideoConfig(), grid), None


def record_video_info(record: dict[str, Any], settings: EncoderSettings, source: VideoSource | None) -> list[dict]:
    """Per video: its name and frames (without a folder: ``num_frames``, what uniform sampling always gives), with a
    folder the sampled indices and the stream's frame count too. Raises ``SampleError``."""
    names = record_videos(record)
    if source is None:
        check_video_model(names, settings)
        return [{"name": name, "frames": settings.num_frames} for name in names]
    return [
        {"name": name, "frames": len(v.frames), "indices": v.indices, "total": v.header.total}
        for name, v in zip(names, load_videos(names, settings, source))
    ]


def _records(data_path: str, template: str) -> list[dict[str, Any]]:
    from neva.data.builtin_sets import BUILTIN_SETS

    if data_path in BUILTIN_SETS:  # the built-in sets' first 20 training records, as the run's seed 0 makes them
        return BUILTIN_SETS[data_path].records(0, "train", 20, "caption" if template == "plain" else "qa")
    return load_records(data_path)


def _samples(record: Any) -> list[tuple[Any, Any, bool]]:
    """``(id, conversation record or the SampleError that skips it, is a preference side)`` of each sample training
    makes of ``record``: a preference record (``prompt``, ``chosen``, ``rejected``; the DPO stage) makes two, its
    chosen and its rejected conversation (``neva.data.preference``), every other record one."""
    rid = record.get("id") if isinstance(record, dict) else None
    if not (isinstance(record, dict) and "prompt" in record and ("chosen" in record or "rejected" in record)):
        return [(rid, record, False)]
    try:
        chosen, rejected = pair_conversations(record)
    except SampleError as exc:
        return [(rid, exc, True)]
    return [(f"{rid} chosen", chosen, True), (f"{rid} rejected", rejected, True)]


def highlight(text: str, spans: tuple[tuple[int, int], ...], color: bool) -> str:
    """``text`` with ``spans`` wrapped in green (a terminal) or ``⟦ ⟧``."""
    left, right = (_GREEN, _RESET) if color else ("⟦", "⟧")
    out, pos = [], 0
    for start, end in spans:
        out += [text[pos:start], left, text[start:end], right]
        pos = end
    out.append(text[pos:])
    return "".join(out)


def preview(args: argparse.Namespace, out=None) -> int:
    """Run the CLI on parsed ``args``; returns the number of skipped samples. ``out``: default the current stdout."""
    out = out or sys.stdout
    from neva.data.templates.registry import get_template, image_token_for
    from neva.data.tokens import tokenizer_image_token_id

    tokenizer = load_tokenizer(args.tokenizer)
    cfg = checkpoint_config(args.tokenizer) if os.path.isdir(args.tokenizer) else None
    if cfg is None and os.path.isdir(args.tokenizer):
        refuse_hf_native(args.tokenizer)
    ckpt_len = cfg.llm.max_seq_len if cfg is not None else None
    spec = native_spec(args.tokenizer, cfg)
    num_image_tokens = 0 if spec is not None else cfg.num_image_tokens if cfg is not None else args.num_image_tokens
    anyres = cfg is not None and cfg.anyres is not None
    if (anyres or spec is not None) and not args.image_folder:
        kind = "AnyRes" if anyres else "native-resolution"
        raise ConfigError(
            f"a {kind} checkpoint's image token counts follow from the images' sizes: pass --image-folder"
        )
    video_tokens, video_token_id = video_rule(cfg, args.video_grid)
    settings = EncoderSettings(
        tokenizer=tokenizer,
        template=get_template(args.conv_template, tokenizer),
        image_token_id=tokenizer_image_token_id(tokenizer, image_token_for(args.conv_template)),
        num_image_tokens=num_image_tokens,
        max_length=args.max_length or ckpt_len,
        image_token_placement=args.image_token_placement,
        tokenization=args.tokenization,
        video_tokens=video_tokens,
        video_token_id=video_token_id,
        num_frames=args.num_frames,
    )
    source = image_source_for(args.image_folder) if args.image_folder else None
    budget = VisualBudget(args.max_visual_tokens, args.visual_budget_action) if args.max_visual_tokens else None
    video_folder = args.video_folder or (
        args.image_folder if args.image_folder and os.path.isdir(args.image_folder) else None
    )
    if args.video_fps is not None and video_folder is None:
        raise ConfigError("--video-fps: a video's frames then follow from its header: pass --video-folder")
    videos_from = VideoSource(video_folder, VideoLimits(args.num_frames, args.video_fps)) if video_folder else None
    records = _records(args.data_path, args.conv_template)
    skipped = 0
    samples = [s for record in (records[: args.limit] if args.limit else records) for s in _samples(record)]
    for rid, record, pair_side in samples:
        try:
            if isinstance(record, SampleError):
                raise record
            images = (
                anyres_images(record, source, cfg)
                if anyres
                else native_images(record, source, spec)
                if spec is not None
                else None
            )
            videos = record_video_info(record, settings, videos_from)
            action = None
            if budget is not None:  # what training's visual budget does to the record (neva.data.visual_budget)
                image_tokens = len(record_images(record)) * num_image_tokens if images is None else sum(
                    i["tokens"] for i in images)  # fmt: skip
                kept, action = budget.fit_frames(
                    image_tokens, [v["frames"] for v in videos], [video_tokens] * len(videos)
                )
                for video, n in zip(videos, kept):
                    if n < video["frames"]:
                        video["frames_before_budget"] = video["frames"]
                        if "indices" in video:
                            picks = np.unique(np.linspace(0, video["frames"] - 1, n).round().astype(int))
                            video["indices"] = [video["indices"][i] for i in picks]
                        video["frames"] = n
            enc, names, tags = encode_media_record(
                record,
                settings,
                None if images is None else [i["tokens"] for i in images],
                [v["frames"] for v in videos],
            )
            input_ids, labels = enc.input_ids, enc.labels
            if pair_side:  # a preference pair learns its final reply only (an assistant turn of the prompt is context)
                labels = last_reply_only(torch.tensor(labels)).tolist()
            if source is not None and images is None:
                for name in names:
                    source.load(name)
        except SampleError as exc:
            skipped += 1
            if args.json:
                out.write(json.dumps({"id": rid, "skipped": exc.reason, "detail": exc.detail}) + "\n")
            else:
                out.write(f"=== {rid}: SKIPPED ({exc.reason}: {exc.detail})\n\n")
            continue
        if images is not None:  # where each image's positions lie in the encoded sample (spans follow each other)
            pos = 0
            for image in images:
                pos = input_ids.index(settings.image_token_id, pos)
                image["positions"] = [pos, pos + image["tokens"]]
                pos += image["tokens"]
        spans = [span for span in tag_spans(input_ids, settings.image_token_id, tags) if span[0] == VIDEO]
        for video, (_, start, end) in zip(videos, spans):
            video.update(tokens=end - start, positions=[start, end])
            if settings.video_token_id is not None:  # the ids training sees
                input_ids[start:end] = [settings.video_token_id] * (end - start)
        if args.json:
            row = {"id": rid, "input_ids": input_ids, "labels": labels}
            row = row if images is None else {**row, "images": images}
            row = row if action is None else {**row, "visual_budget": action}
            out.write(json.dumps({**row, "videos": videos} if videos else row) + "\n")
            continue
        messages = place_image_tags(parse_conversations(record.get("conversations")), settings.image_token_placement)
        rendered = settings.template.render(messages, settings.system_prompt)
        learned = sum(label != -100 for label in labels)
        learned_spans = rendered.learned_spans[-1:] if pair_side else rendered.learned_spans
        cut = f" (truncated from {enc.truncated_from})" if enc.truncated_from is not None else ""
        cut += " (leading gpt turn dropped)" if enc.dropped_leading_reply else ""
        cut += f" (over model.data.max_visual_tokens={budget.max_tokens}: {action})" if action else ""
        per_image = (
            f"× {num_image_tokens} tokens" if images is None else "(AnyRes)" if anyres else "(native resolution)"
        )
        out.write(
            f"=== {rid}: {len(input_ids)} tokens{cut}, {learned} learned, {count_image_tags(messages)} image(s) "
            f"{per_image}\n"
            + "".join(
                f"    {i['name']}: {i['size'][1]}x{i['size'][0]} px → grid {i['grid'][0]}x{i['grid'][1]} (rows x cols), "
                f"{i['tiles']} tiles with the overview, {i['tokens']} positions [{i['positions'][0]}, "
                f"{i['positions'][1]})\n"
                for i in (images or [])
                if anyres
            )
            + "".join(
                f"    {i['name']}: {i['size'][1]}x{i['size'][0]} px → {i['resized'][1]}x{i['resized'][0]} px, "
                f"{i['grid'][0]}x{i['grid'][1]} patches, {i['tokens']} positions [{i['positions'][0]}, "
                f"{i['positions'][1]})\n"
                for i in (images or [])
                if not anyres
            )
            + "".join(
                f"    {v['name']}: {v['frames']} frames"
                + (f" (of {v['frames_before_budget']}: visual budget)" if "frames_before_budget" in v else "")
                + (f" at {v['indices']} of {v['total']}" if "indices" in v else " (uniform; not decoded)")
                + f", {v['tokens']} positions [{v['positions'][0]}, {v['positions'][1]})\n"
                for v in videos
            )
            + f"{highlight(rendered.text, learned_spans, args.color)}\n\n"
        )
    if not args.json:
        out.write(f"{skipped} of {len(samples)} samples skipped\n")
    return skipped


def build_parser() -> argparse.ArgumentParser:
    """The CLI's arguments."""
    p = argparse.ArgumentParser(prog="python -m neva.data.preview", description=__doc__.splitlines()[0])
    p.add_argument("--data-path", required=True, help="LLaVA .json/.jsonl file, or 'synthetic'")
    p.add_argument("--image-folder", default=None, help="directory or .tar; when given, images are checked too")
    p.add_argument("--conv-template", required=True, choices=TEMPLATES)
    p.add_argument("--tokenizer", required=True, help="tokenizer or neva checkpoint directory, or 'synthetic'")
    p.add_argument("--limit", type=int, default=None, help="first N records only")
    p.add_argument("--json", action="store_true", help="one JSON object per sample and line")
    p.add_argument("--num-image-tokens", type=int, default=576, help="used unless --tokenizer is a neva checkpoint")
    p.add_argument("--max-length", type=int, default=None, help="truncate / skip as training would")
    p.add_argument("--image-token-placement", choices=("front", "inline"), default="front")
    p.add_argument("--tokenization", choices=TOKENIZATIONS, default="neva")
    p.add_argument("--color", action=argparse.BooleanOptionalAction, default=None, help="ANSI highlight")
    p.add_argument("--video-folder", default=None, help="directory of the videos (default: --image-folder)")
    p.add_argument("--num-frames", type=int, default=8, help="frames sampled per video (model.data.num_frames)")
    p.add_argument("--video-fps", type=float, default=None, help="model.data.video_fps (needs the videos)")
    p.add_argument("--max-visual-tokens", type=int, default=None, help="model.data.max_visual_tokens")
    p.add_argument(
        "--visual-budget-action",
        choices=("skip", "fewer_frames"),
        default="skip",
        help="model.data.visual_budget_action (downscale resizes native / AnyRes images: not previewed)",
    )
    p.add_argument(
        "--video-grid", type=int, default=24, help="the tower's patch grid, unless --tokenizer is a neva checkpoint"
    )
    return p


@entry_point
def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    args = build_parser().parse_args(argv)
    if args.color is None:
        args.color = sys.stdout.isatty()
    preview(args)


if __name__ == "__main__":
    main()
