"""The end-of-stage consolidated checkpoint (neva format: what generate, convert and the next stage read)."""

from __future__ import annotations

from pathlib import Path

from neva.checkpoint import neva_format
from neva.checkpoint.source import ModelSource
from neva.parallel.consolidate import consolidated_tensors
from neva.training.engine import Engine


def save_final(engine: Engine, source: ModelSource, directory: str | Path, is_writer: bool = True, **metadata) -> Path:
    """Write the consolidated checkpoint (rank 0 writes; all ranks must call for the gathers)."""
    tensors = consolidated_tensors(engine.parallel)
    if not is_writer:
        for _ in tensors:  # take part in the collective gathers
            pass
        return Path(directory)
    return neva_format.save_checkpoint(
        directory, source.cfg, tensors, source.tokenizer, metadata=metadata or None, overwrite=True
    )
