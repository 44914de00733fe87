"""Write files and directories atomically: build them under a temporary name, rename them when complete."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_directory(target: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh ``TARGET.tmp-*`` directory next to ``target`` and rename it to ``target`` on success.

    A crash or exception leaves no half-written ``target`` behind (the temporary directory is removed). An existing
    ``target`` is only replaced, with ``overwrite``, after the new one is complete.

    Raises:
        FileExistsError: ``target`` exists and ``overwrite`` is False.
    """
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists (pass overwrite=True to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        old = None
        if target.exists():
            old = target.with_name(f"{target.name}.old-{os.getpid()}")
            target.rename(old)
        tmp.rename(target)  # atomic on one filesystem
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write(path: str | os.PathLike, write) -> None:
    """``write(file_object)`` into a temp file beside ``path``, fsync, then rename: readers never see half a file.

    The temp file is ``.NAME.*.tmp``; one left by a killed process is removed at the next run's start
    (``neva.checkpoint.verified.remove_stale_temp``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
