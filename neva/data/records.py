"""LLaVA JSON / JSONL files → record dicts; unreadable lines become error records so they are counted, not lost.

Also names ``.tar`` shard specs (read by ``neva.data.shards``).
"""

from __future__ import annotations

import json
import os
from typing import Any

ERROR_KEY = "__error__"
"""Key of a placeholder record for a line that could not be read; its value is the skip reason."""


def load_records(path: str) -> list[dict[str, Any]]:
    """Read a LLaVA ``.json`` (a list) or ``.jsonl`` (one object per line) file.

    A JSON list that does not parse is a hard error (nothing in it can be trusted); in JSONL each bad line is one
    error record (``malformed_json`` / ``invalid_utf8``) that the dataset skips and counts.
    Records without an ``id`` get ``"{file}:{n}"``.

    Raises:
        ValueError: a file whose top level is one JSON value other than a list (a JSON object, say, which would
            otherwise read as a single record), or a JSON list that does not parse.
    """
    name = os.path.basename(path)
    with open(path, "rb") as f:
        raw = f.read()
    head = raw.lstrip()[:1]
    if head == b"[":
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not valid UTF-8 JSON: {exc}") from exc
        lines: list[Any] = data
        return [_with_id(rec, f"{name}:{i}") for i, rec in enumerate(lines)]
    _refuse_single_value(raw, path)
    records = []
    for n, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        records.append(parse_record(line, f"{name}:{n}"))
    return records


def _refuse_single_value(raw: bytes, path: str) -> None:
    """Raise when the whole file is one JSON value that is not a JSONL file of one record.

    JSONL starts with ``{`` too, so a file is read as lines unless it parses as a whole: then it is one value, and
    only a single-line object in a ``.jsonl`` file is a (one-record) JSONL file.
    """
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return  # several lines of JSONL (or bad lines, which are skipped and counted one by one)
    one_line = len(raw.strip().splitlines()) == 1
    if isinstance(value, dict) and one_line and path.endswith(".jsonl"):
        return
    kind = "an object" if isinstance(value, dict) else f"a {type(value).__name__}"
    keys = f" (keys: {', '.join(list(map(repr, value))[:5])})" if isinstance(value, dict) else ""
    hint = "; a one-record JSONL file must be named .jsonl" if isinstance(value, dict) and one_line else ""
    raise ValueError(
        f"{path}: the top level is {kind}{keys}; expected a JSON list of LLaVA records ([{{...}}, {{...}}]) "
        f"or JSONL (one record per line){hint}"
    )


def parse_record(raw: bytes, default_id: str) -> dict[str, Any]:
    """One JSON object (a JSONL line, or a shard's ``KEY.json`` member) → record, or an error record.

    Shared by both formats so that a bad record is skipped for the same reason wherever it is stored.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return {"id": default_id, ERROR_KEY: "invalid_utf8", "detail": str(exc)}
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as exc:
        return {"id": default_id, ERROR_KEY: "malformed_json", "detail": str(exc)}
    return _with_id(rec, default_id)


def is_shard_spec(path: str) -> bool:
    """True when a ``data_path`` entry names ``.tar`` shards (one file or a brace pattern) rather than JSON/JSONL."""
    return path.endswith(".tar")


def expand_shard_spec(spec: str) -> list[str]:
    """``/data/llava-{000000..000123}.tar`` → the shard paths, in order (zero padding kept)."""
    # braceexpand is webdataset's own pattern expander, so patterns mean here what they mean to webdataset tools;
    # imported here so that reading the config does not need it unless shards are used.
    from braceexpand import braceexpand

    return list(braceexpand(spec))


def _with_id(rec: Any, default_id: str) -> dict[str, Any]:
    if not isinstance(rec, dict):
        return {"id": default_id, ERROR_KEY: "malformed_json", "detail": f"record is not an object: {rec!r:.80}"}
    if "id" not in rec:
        rec = {**rec, "id": default_id}
    return rec


def record_images(record: dict[str, Any]) -> list[Any]:
    """A record's image names as a list (LLaVA allows one string or a list)."""
    image = record.get("image", record.get("images"))
    if image is None:
        return []
    return list(image) if isinstance(image, (list, tuple)) else [image]


def record_videos(record: dict[str, Any]) -> list[Any]:
    """A record's video names as a list (``"video"``: one string or a list; ``"videos"`` too)."""
    video = record.get("video", record.get("videos"))
    if video is None:
        return []
    return list(video) if isinstance(video, (list, tuple)) else [video]


def approx_length(
    record: dict[str, Any], num_image_tokens: int, image_tokens: int | None = None, video_tokens: int = 0
) -> int:
    """LLaVA's ``modality_lengths``: word count (+ image and video tokens), negative for text-only records.

    Cheap enough to compute for every record before training (no tokenizer, no image decode). ``image_tokens``: the
    record's images' positions when they vary (AnyRes); None: ``num_image_tokens`` each. ``video_tokens``: positions
    of one video at ``num_frames`` frames (the most a video takes).
    """
    convs = record.get("conversations")
    words = 0
    if isinstance(convs, list):
        for turn in convs:
            value = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
            if isinstance(value, str):
                words += len(value.split())
    n_images, n_videos = len(record_images(record)), len(record_videos(record))
    words = max(words, 1)
    if not (n_images or n_videos):
        return -words
    images = n_images * num_image_tokens if image_tokens is None else image_tokens
    return words + images + n_videos * video_tokens
