"""Say which rank timed out in which collective (``model.distributed_timeout_minutes``).

Gloo reports only ``Timed out waiting 6000ms for recv operation to complete`` (no rank, and its own transport
operation rather than the collective). ``timeout_note`` recognises such an error and names this process's rank, its
mesh coordinates, the torch.distributed call it was in and the neva line that made it; the caller logs the note and
attaches it to the error, which is re-raised unchanged.
"""

from __future__ import annotations

import re
import traceback
from datetime import timedelta
from pathlib import Path

from neva.parallel.layout import Layout, mesh_coords

_TIMEOUT_TEXT = re.compile(r"timed out|timeout", re.IGNORECASE)
_BACKEND_TEXT = re.compile(r"gloo|nccl|c10d|ProcessGroup|Watchdog", re.IGNORECASE)
_DIST = str(Path("torch", "distributed"))
_NEVA = Path(__file__).resolve().parents[1]  # the neva package


def _in_neva(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(_NEVA)


def _chain(err: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while err is not None and err not in out:
        out.append(err)
        err = err.__cause__ or err.__context__
    return out


def timeout_note(err: BaseException, timeout: timedelta, rank: int, layout: Layout | None = None) -> str | None:
    """A one-line explanation when ``err`` is a collective timeout, else None.

    A timeout is an error whose text says so and that came from torch.distributed (a frame of its Python code, or the
    backend's own wording: a DDP gradient bucket fails inside ``backward`` with no torch.distributed frame).
    """
    for e in _chain(err):
        text = str(e)
        frames = traceback.extract_tb(e.__traceback__)
        dist_frames = [f for f in frames if _DIST in f.filename]
        if _TIMEOUT_TEXT.search(text) and (dist_frames or _BACKEND_TEXT.search(text)):
            break
    else:
        return None
    op = f"torch.distributed {dist_frames[-1].name}" if dist_frames else "a collective"
    neva_frames = [f for f in frames if _in_neva(f.filename)]
    where = ""
    if neva_frames:
        f = neva_frames[-1]
        where = f" (called from {Path(f.filename).resolve().relative_to(_NEVA.parent)}:{f.lineno} in {f.name})"
    coords = ""
    if layout is not None and layout.is_distributed:
        pp, dp, cp, tp = mesh_coords(rank, layout)
        coords = f" (pp {pp}, dp {dp}, {f'cp {cp}, ' if layout.cp > 1 else ''}tp {tp})"
    seconds = timeout.total_seconds()
    return (
        f"rank {rank}{coords}: {op}{where} timed out after {seconds:g} s "
        f"(model.distributed_timeout_minutes={seconds / 60:g}). Another rank did not take part in time: it died or "
        "hangs (see its own log), or the ranks ran different collectives. Raise model.distributed_timeout_minutes "
        "only if a rank legitimately works alone that long (e.g. a slow checkpoint write)."
    )
