"""Where a run started, in every one of its step checkpoints: the starting neva checkpoint's absolute path and
sha256, so that export and serving of any step read the same weights from anywhere and refuse other ones.

A step checkpoint holds what the run trained; what it froze (a finetune's tower, every base weight under LoRA) and
the tokenizer come from the checkpoint the run started from. The run's recorded config may name that start
relatively, or not at all (a stage's default start beside its ``exp_dir``, ``checkpoint/source.default_start``), so
read from another directory it would find nothing, or another run's output, and merge onto the wrong weights.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from neva.checkpoint import neva_format
from neva.typed import ConfigError

START_KEY = "neva_start"
_CHUNK = 16 << 20


def directory_digest(directory: str | os.PathLike) -> str:
    """sha256 over every file of ``directory`` (relative names and bytes, in name order)."""
    root = Path(directory)
    sha = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        sha.update(path.relative_to(root).as_posix().encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
        sha.update(b"\0")
    return sha.hexdigest()


def start_record(checkpoint: str | os.PathLike | None) -> dict[str, str] | None:
    """``{"path": absolute path, "sha256": digest}`` of the neva checkpoint a run starts from (None: fresh or HF)."""
    if checkpoint is None:
        return None
    path = os.path.abspath(checkpoint)
    return {"path": path, "sha256": directory_digest(path)}


def recorded_start(record: dict[str, Any] | None, step_path: str | os.PathLike) -> str | None:
    """The start a step checkpoint records, checked against what is on disk now (None: the run recorded none).

    Raises:
        ConfigError: the recorded start is gone, or its files are not the ones the run started from.
    """
    if not record:
        return None
    path = record["path"]
    if not neva_format.is_neva_checkpoint(path):
        raise ConfigError(
            f"{step_path} trained on top of {path} (recorded when the run started), which holds no neva checkpoint "
            "now: its frozen weights and tokenizer are read from there. Put that checkpoint back at the same path"
        )
    digest = directory_digest(path)
    if digest != record["sha256"]:
        raise ConfigError(
            f"{step_path} trained on top of {path}, whose files changed since (sha256 {record['sha256'][:12]}… "
            f"recorded, {digest[:12]}… now): merging the step onto other weights would give another model. Restore "
            "the starting checkpoint the run used"
        )
    return path
