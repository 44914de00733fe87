"""Write LLaVA JSON/JSONL + an image folder as ``.tar`` shards (``neva.data.shards`` layout) with sample-count indexes.

::

    python -m neva.data.make_shards --data-path llava.json --image-folder DIR --out /data/llava \\
        --samples-per-shard 5000 [--shuffle-seed 0] [--video-folder VDIR]
    python -m neva.data.make_shards --index '/data/llava-{000000..000123}.tar'   # index shards made elsewhere

Sample ``KEY`` (the record's position, 9 digits) holds ``KEY.json`` (the record, its ``image`` renamed to the
members) and its images, bytes unchanged: ``KEY.jpg`` for a single image, ``KEY.0.jpg``, ``KEY.1.png``... for a list;
its videos (``video`` / ``videos``, from ``--video-folder``, default the image folder, as training's
``model.data.video_folder``) the same way as ``KEY.video.mp4`` or ``KEY.video.0.mp4``... (decoded when read, with the
caps and skips of a video file). An image or video that cannot be read keeps its original name in the record, so
training skips the sample for the same reason (``missing_image`` / ``unsafe_video_path``...) as it would from the JSON
file. Unreadable JSONL lines are not written.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import webdataset

from neva.data.images import FolderImageSource, ImageError
from neva.data.records import ERROR_KEY, expand_shard_spec, load_records
from neva.data.shards import count_samples, index_path, write_index
from neva.data.video import as_video_error

# (record fields, member suffix prefix, the error a missing source raises) of each kind of media a shard carries.
_IMAGES = (("image", "images"), "", "image")
_VIDEOS = (("video", "videos"), "video.", "video")


def _extension(name: str) -> str:
    # The suffix names the member; it must be one webdataset-safe token (no dots, no slashes).
    ext = os.path.splitext(name)[1][1:].lower()
    return ext if re.fullmatch(r"[a-z0-9]+", ext) else "img"


def _pack_media(
    rec: dict[str, Any], sample: dict[str, Any], kind: tuple, source: FolderImageSource | None, problems: Counter
) -> None:
    """Copy the files the record's ``kind`` field names into ``sample`` and rename them in ``rec`` to the members."""
    fields, prefix, what = kind
    field = next((f for f in fields if f in rec), None)
    if field is None or rec[field] is None:
        return
    value = rec[field]
    names = list(value) if isinstance(value, (list, tuple)) else [value]
    renamed = []
    for j, name in enumerate(names):
        suffix = prefix + (_extension(name) if isinstance(value, str) else f"{j}.{_extension(str(name))}")
        try:
            if source is None:
                raise ImageError("missing_image", f"no --{what}-folder given")
            sample[suffix] = source.read_bytes(name)
            renamed.append(f"{sample['__key__']}.{suffix}")
        except ImageError as exc:
            problems[(exc if what == "image" else as_video_error(exc)).reason] += 1
            renamed.append(name)
    rec[field] = renamed[0] if isinstance(value, str) else renamed


def shard_sample(
    record: dict[str, Any],
    key: str,
    images: FolderImageSource | None,
    problems: Counter,
    videos: FolderImageSource | None = None,
) -> dict[str, Any]:
    """One record → the ``TarWriter`` dict of its members (``__key__``, ``json``, images read from ``images``,
    videos from ``videos``: their bytes, undecoded)."""
    sample: dict[str, Any] = {"__key__": key}
    rec = dict(record)
    _pack_media(rec, sample, _IMAGES, images, problems)
    _pack_media(rec, sample, _VIDEOS, videos, problems)
    sample["json"] = json.dumps(rec, ensure_ascii=False).encode("utf-8")
    return sample


def make_shards(
    data_paths: Sequence[str],
    image_folder: str | None,
    out: str,
    samples_per_shard: int,
    shuffle_seed: int | None = None,
    video_folder: str | None = None,
) -> list[str]:
    """Write the shards ``{out}-000000.tar``... and their indexes; returns the shard paths (videos from
    ``video_folder``, default ``image_folder``).

    Raises:
        ValueError: ``samples_per_shard`` < 1 or no readable record.
    """
    if samples_per_shard < 1:
        raise ValueError(f"--samples-per-shard must be >= 1, got {samples_per_shard}")
    records = [r for path in data_paths for r in load_records(path)]
    problems: Counter[str] = Counter()
    good = [r for r in records if ERROR_KEY not in r]
    problems["unreadable_record"] += len(records) - len(good)
    if not good:
        raise ValueError(f"no readable record in {list(data_paths)}")
    if shuffle_seed is not None:
        # LLaVA files are grouped by source data set; shard-level shuffling alone would keep those runs together.
        good = [good[i] for i in np.random.default_rng(shuffle_seed).permutation(len(good))]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    images = FolderImageSource(image_folder) if image_folder is not None else None
    video_dir = video_folder or image_folder
    videos = FolderImageSource(video_dir) if video_dir is not None else None  # the same path rules, for the bytes
    shards = []
    for start in range(0, len(good), samples_per_shard):
        path = f"{out}-{len(shards):06d}.tar"
        chunk = good[start : start + samples_per_shard]
        with webdataset.TarWriter(path, encoder=False) as writer:
            for i, record in enumerate(chunk, start=start):
                writer.write(shard_sample(record, f"{i:09d}", images, problems, videos))
        write_index(path, len(chunk))
        shards.append(path)
    for reason, n in sorted(problems.items()):
        if n:
            print(f"warning: {n} × {reason}", file=sys.stderr)
    return shards


def shard_pattern(shards: Sequence[str], out: str) -> str:
    """The brace pattern naming ``shards`` (what ``model.data.data_path`` takes)."""
    return shards[0] if len(shards) == 1 else f"{out}-{{000000..{len(shards) - 1:06d}}}.tar"


def data_path_override(pattern: str) -> str:
    """``model.data.data_path=PATTERN`` as one shell word that pastes as is into bash and reaches Hydra intact.

    Unquoted, bash brace-expands the pattern into one argument per shard (Hydra then keeps the last: training on one
    shard) and Hydra's override grammar reads ``{...}`` as a dictionary; so the value is a Hydra quoted string
    (quotes, backslashes before them and ``${`` escaped) and the whole override is shell-quoted.
    """
    # Hydra's quoted strings: backslashes are literal except before a quote (or the closing one), ${ interpolates.
    escaped = re.sub(r'(\\*)("|$)', lambda m: m.group(1) * 2 + ("\\" + m.group(2) if m.group(2) else ""), pattern)
    hydra_value = '"' + escaped.replace("${", "\\${") + '"'
    return shlex.quote(f"model.data.data_path={hydra_value}")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", nargs="+", help="LLaVA .json/.jsonl file(s)")
    parser.add_argument("--image-folder", help="directory the records' image paths are relative to")
    parser.add_argument("--video-folder", help="directory the records' video paths are relative to (default: images')")
    parser.add_argument("--out", help="output prefix: writes PREFIX-000000.tar, PREFIX-000000.idx.json, ...")
    parser.add_argument("--samples-per-shard", type=int, default=5000)
    parser.add_argument("--shuffle-seed", type=int, default=None, help="shuffle the records before writing")
    parser.add_argument("--index", metavar="SHARDS", help="only write .idx.json for existing shards (brace pattern)")
    args = parser.parse_args(argv)
    if args.index:
        for shard in expand_shard_spec(args.index):
            if os.path.exists(index_path(shard)):
                os.remove(index_path(shard))  # count from the shard itself, not from a possibly stale index
            write_index(shard, count_samples(shard))
        print(f"indexed {args.index}")
        return 0
    if not args.data_path or not args.out:
        parser.error("--data-path and --out are required (or --index)")
    shards = make_shards(
        args.data_path, args.image_folder, args.out, args.samples_per_shard, args.shuffle_seed, args.video_folder
    )
    print(f"wrote {len(shards)} shard(s); train on them with the override (quoted for bash and Hydra):")
    print(data_path_override(shard_pattern(shards, args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
