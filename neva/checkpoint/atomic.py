"""Create a checkpoint directory atomically: build it under a temporary name, rename it when complete."""

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
