"""The end-of-stage consolidated checkpoint (neva format: what generate, convert and the next stage read)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from neva.checkpoint import neva_format
from neva.models.lora import merged_state_dict
from neva.training.build import ModelSource
from neva.training.engine import Engine


def consolidated_tensors(engine: Engine) -> Iterator[tuple[str, torch.Tensor]]:
    """Full (unsharded, LoRA-merged) tensors under plain neva keys; trained weights from the fp32 masters under O2.

    Distributed engines provide ``full_state_dict_iter`` (gathering one tensor at a time, every rank taking part).
    """
    full = getattr(engine, "full_state_dict_iter", None)
    if full is not None:
        yield from full()
        return
    if engine.master is not None:
        engine.master.publish()
    masters = dict(engine.master.named_master) if engine.master is not None else {}
    for key, value in merged_state_dict(engine.model).items():
        if key.endswith("inv_freq"):
            continue
        master = masters.get(key)
        yield key, (master if master is not None else value).detach().float().cpu()


def save_final(engine: Engine, source: ModelSource, directory: str | Path, is_writer: bool = True, **metadata) -> Path:
    """Write the consolidated checkpoint (rank 0 writes; all ranks must call for the gathers)."""
    tensors = consolidated_tensors(engine)
    if not is_writer:
        for _ in tensors:  # take part in the collective gathers
            pass
        return Path(directory)
    return neva_format.save_checkpoint(
        directory, source.cfg, tensors, source.tokenizer, metadata=metadata or None, overwrite=True
    )
