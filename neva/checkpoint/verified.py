"""Training checkpoints that are checked before they are trusted.

Every training checkpoint, a one-process file or a distributed run's DCP directory, gets a manifest: the step, and the
size and sha256 of each of its files. It is written last and atomically (``step=N.ckpt.manifest.json`` beside a file,
``manifest.json`` inside a directory), so a checkpoint whose save was interrupted has none. Hashes are taken from the
bytes on their way to disk (``HashingWriter``): saving reads nothing back. Resume (``find_resume``) verifies
candidates newest first and takes the first intact one; loading (``load_state``) accepts tensors and plain data only,
so a planted file cannot run code however it got there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint.atomic import atomic_write
from neva.errors import InputError

log = logging.getLogger(__name__)

LAST_NAME = "last.ckpt"
STEP_NAME = re.compile(r"step=(\d+)\.ckpt")
DIR_MANIFEST = "manifest.json"
FILE_MANIFEST_SUFFIX = ".manifest.json"
MANIFEST_FORMAT = "neva-checkpoint-manifest"
_CHUNK = 16 << 20
CONFIG_KEY = "neva_config"
"""The checkpoint entry holding the run's resolved config as JSON text (resume checks, step-checkpoint conversion)."""


class CheckpointError(InputError, RuntimeError):
    """A training checkpoint that is incomplete, corrupt, or holds something other than neva's plain data."""


class HashingWriter:
    """A write-only file object that passes bytes on to ``f`` and hashes them on the way (what torch.save and DCP's
    writer use of a file: write, tell, flush, fileno, close)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.f.write(view)  # buffered files write everything or raise
        self.sha.update(view)
        self.size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.f.tell()

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()

    def close(self) -> None:
        self.f.close()

    def digest(self) -> dict[str, Any]:
        return {"bytes": self.size, "sha256": self.sha.hexdigest()}


def file_digest(path: Path) -> dict[str, Any]:
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": sha.hexdigest()}


def manifest_path(ckpt: str | os.PathLike) -> Path:
    ckpt = Path(ckpt)
    return ckpt / DIR_MANIFEST if ckpt.is_dir() else ckpt.with_name(ckpt.name + FILE_MANIFEST_SUFFIX)


def write_manifest(ckpt: str | os.PathLike, files: dict[str, dict[str, Any]], step: int) -> None:
    """Record ``files`` (name relative to the directory ``ckpt``, or ``ckpt``'s own name for a file → digest)."""
    data = {"format": MANIFEST_FORMAT, "version": 1, "step": int(step), "files": dict(sorted(files.items()))}
    atomic_write(manifest_path(ckpt), lambda f: f.write((json.dumps(data, indent=1) + "\n").encode()))


def remove_manifest(ckpt: str | os.PathLike) -> None:
    """Drop the manifest first when ``ckpt`` is about to be rewritten or removed: a save interrupted from here on
    leaves a checkpoint without one, which resume skips, never one that claims the old contents."""
    manifest_path(ckpt).unlink(missing_ok=True)


def save_hashed(obj: Any, path: str | os.PathLike) -> dict[str, Any]:
    """``torch.save`` ``obj`` into ``path`` atomically; returns the digest of the bytes written."""
    digests = []

    def write(f: Any) -> None:
        hashing = HashingWriter(f)
        torch.save(obj, hashing)
        digests.append(hashing.digest())

    atomic_write(path, write)
    return digests[0]


def save_file(checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    """Write a one-process checkpoint file, then its manifest."""
    path = Path(path)
    remove_manifest(path)
    write_manifest(path, {path.name: save_hashed(checkpoint, path)}, checkpoint.get("global_step", 0))


def read_manifest(ckpt: Path) -> dict[str, Any]:
    path = manifest_path(ckpt)
    if not path.is_file():
        raise CheckpointError(
            f"{ckpt.name}: no manifest ({path.name}): its save did not finish, or neva did not write it"
        )
    try:
        data = json.loads(path.read_text())
        files = data.get("files") if isinstance(data, dict) else None
        if data.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError("not a neva checkpoint manifest")
        if not all(isinstance(v, dict) for v in files.values()):
            raise ValueError("a file entry is not an object")
        int(data["step"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{ckpt.name}: unreadable manifest {path.name}: {err}") from err
    return data


def verify(ckpt: str | os.PathLike) -> int:
    """Check every file of ``ckpt`` against its manifest (sizes, then sha256); returns the step it holds.

    Raises:
        CheckpointError: no or unreadable manifest, a file missing, added, truncated or changed.
    """
    ckpt = Path(ckpt)
    data = read_manifest(ckpt)
    listed = data["files"]
    if ckpt.is_dir():
        root = ckpt
        # Temp files of a save interrupted before this one completed are not part of it (and are removed at start).
        present = {p.name for p in ckpt.iterdir() if p.name != DIR_MANIFEST and not p.name.endswith(".tmp")}
    else:
        root, present = ckpt.parent, {ckpt.name}
    if set(listed) != present:
        raise CheckpointError(
            f"{ckpt.name}: its files {sorted(present)} are not those of its manifest {sorted(listed)}; missing: "
            f"{sorted(set(listed) - present)}, unlisted: {sorted(present - set(listed))}"
        )
    where = {name: f"{ckpt.name}/{name}" if root == ckpt else name for name in listed}
    for name in sorted(listed):  # sizes first: a truncated file is found without reading anything
        want = listed[name].get("bytes")
        size = (root / name).stat().st_size
        if size != want:
            raise CheckpointError(f"{where[name]}: {size} bytes, its manifest says {want} (truncated?)")
    for name in sorted(listed):
        if file_digest(root / name)["sha256"] != listed[name].get("sha256"):
            raise CheckpointError(f"{where[name]}: does not match the sha256 of its manifest (corrupted on disk)")
    return int(data["step"])


def _claimed_step(ckpt: Path) -> int:
    try:
        return int(read_manifest(ckpt)["step"])
    except CheckpointError:
        return -1


def find_resume(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest intact checkpoint in ``ckpt_dir`` (``last.ckpt`` or ``step=N.ckpt``), or None when there is none.

    Candidates are verified newest first (by the step their manifest claims); each one skipped is logged with the
    reason, so a corrupt or half-written ``last.ckpt`` falls back to the newest intact ``step=N.ckpt``.

    Raises:
        CheckpointError: checkpoints exist but none is intact: starting from step 0 would overwrite that run.
    """
    ckpt_dir = Path(ckpt_dir)
    names = sorted(os.listdir(ckpt_dir)) if ckpt_dir.is_dir() else []
    candidates = [ckpt_dir / n for n in names if n == LAST_NAME or STEP_NAME.fullmatch(n)]
    candidates.sort(key=lambda p: (_claimed_step(p), p.name == LAST_NAME), reverse=True)
    skipped = []
    for ckpt in candidates:
        try:
            verify(ckpt)
        except (CheckpointError, OSError) as err:
            skipped.append(str(err) if isinstance(err, CheckpointError) else f"{ckpt.name}: {err}")
            continue
        if skipped:
            log.warning("skipped %d checkpoint(s) that failed verification: %s", len(skipped), "; ".join(skipped))
        return ckpt
    if skipped:
        raise CheckpointError(
            f"{ckpt_dir} holds checkpoints but none is intact, so the run cannot resume; refusing to start over it "
            f"from step 0. " + "; ".join(skipped) + ". Move them away (or use another exp_manager.exp_dir) to start "
            "afresh."
        )
    return None


def remove_stale_temp(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Delete the temp files of saves that were killed (``.NAME.*.tmp`` of atomic writes, DCP's ``.metadata.tmp``),
    in ``ckpt_dir`` and its checkpoint directories; returns what was removed. Only call it before this run saves."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    dirs = [ckpt_dir] + [p for p in ckpt_dir.iterdir() if p.is_dir() and not p.is_symlink()]
    stale = [p for d in dirs for p in d.iterdir() if p.name.endswith(".tmp") and p.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    if stale:
        log.info("removed %d temp file(s) of interrupted saves: %s", len(stale), ", ".join(p.name for p in stale))
    return stale


def load_state(path: str | os.PathLike) -> dict[str, Any]:
    """``torch.load`` a checkpoint file (or DCP's loop-state file) with ``weights_only=True``: tensors, numbers,
    strings and containers of them, which is all neva writes; anything else is refused before it can run.

    Raises:
        CheckpointError: the file holds other Python objects (e.g. a ``__reduce__`` payload).
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = next((line.strip() for line in str(err).splitlines() if "Unpickler error" in line), str(err))
        raise CheckpointError(
            f"{path} holds pickled Python objects that are not tensors or plain data; neva never writes those and "
            f"does not load them (loading could run code). {reason}"
        ) from err
