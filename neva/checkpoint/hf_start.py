"""An HF directory given where a neva checkpoint is expected (``model.restore_from_path``, ``neva.generate`` /
``neva.evaluate --checkpoint``) is imported on the fly, as ``neva.convert hf-to-neva`` would import it, as
LLaMA-Factory and ms-swift start from an HF directory directly.

A training run imports once into ``<exp_dir>/imported_start`` (rank 0; the other ranks wait for it to appear, the
directory being renamed into place only when complete) and starts from that checkpoint, whose metadata records the
conversion (``source``: the HF path) and what the HF directory was trained with (template, pixel budget): a rerun or a
resume finds it there and imports nothing. Serving imports into a temporary directory (``neva.evaluate`` loads one in
memory instead: ``hf_in_memory``). The families imported so are those whose interop (``interop.Interop``) recognises
the directory's config alone: Qwen-VL and the llava-hf wrappers; LLaVA's own layout needs ``hf-to-neva``'s
``--vision`` / ``--llm`` and is left to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from neva.checkpoint import neva_format
from neva.config import TrainConfig

log = logging.getLogger("neva.train")

IMPORTED_START = "imported_start"
_WAIT_SECONDS = 3600.0  # how long a non-zero rank waits for rank 0's import


def hf_model_type(path: str | os.PathLike) -> str | None:
    """The ``model_type`` of an HF model directory a family's interop imports from the directory alone (its
    ``Interop.recognises``: Qwen-VL, the llava-hf wrappers), else None."""
    from neva.checkpoint.interop import interop_for_hf
    from neva.checkpoint.llava_original import read_llava_config

    config = Path(path) / "config.json"
    if not config.is_file() or neva_format.is_neva_checkpoint(path):
        return None
    try:
        hf = json.loads(config.read_text())
    except ValueError:
        return None  # whoever reads it next says what is wrong with it
    if not isinstance(hf, dict) or "model_type" not in hf or read_llava_config(path) is not None:
        return None
    return hf["model_type"] if interop_for_hf(hf).recognises(hf) else None


def import_hf(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Import HF directory ``path`` (``hf_model_type``) into neva checkpoint ``out``, as ``hf-to-neva`` does: through
    its family's interop."""
    from neva.checkpoint.interop import interop_for_hf

    return interop_for_hf(json.loads((Path(path) / "config.json").read_text())).import_dir(path, out)


def imported_start(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` starting from ``<exp_dir>/imported_start`` when its ``model.restore_from_path`` is an HF directory
    (imported there first, once); unchanged otherwise."""
    restore = cfg.model.restore_from_path
    if restore is None or hf_model_type(restore) is None:
        return cfg
    out = Path(cfg.exp_manager.exp_dir) / IMPORTED_START
    source = str(Path(restore).resolve())
    if not _imported_from(out, source):
        if int(os.environ.get("RANK", "0")) == 0:
            if out.exists():
                raise FileExistsError(
                    f"{out} holds an import of another directory than model.restore_from_path={restore}: remove it, or "
                    "give this run another exp_manager.exp_dir"
                )
            log.info("model.restore_from_path=%s is an HF %s directory: importing it into %s", restore,
                     hf_model_type(restore), out)  # fmt: skip
            import_hf(restore, out)
        else:
            _wait_for(out, source)
    log.info("starting from %s, imported from the HF directory %s (neva.convert hf-to-neva)", out, restore)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, restore_from_path=str(out)))


def _imported_from(out: Path, source: str) -> bool:
    if not neva_format.is_neva_checkpoint(out):
        return False
    recorded = neva_format.load_metadata(out).get("source", {}).get("path")
    return recorded is not None and str(Path(recorded).resolve()) == source


def _wait_for(out: Path, source: str) -> None:
    deadline = time.monotonic() + _WAIT_SECONDS
    while not _imported_from(out, source):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not finish importing {source} into {out} within {_WAIT_SECONDS:.0f} s")
        time.sleep(1.0)


@contextlib.contextmanager
def as_imported(path: str | os.PathLike) -> Iterator[Path]:
    """``path`` itself, or an HF directory (``hf_model_type``) imported into a temporary directory (removed on exit)."""
    if hf_model_type(path) is None:
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="neva-hf-") as tmp:
        log.info("%s is an HF %s directory: imported for this run (neva.convert hf-to-neva)", path, hf_model_type(path))
        yield import_hf(path, Path(tmp) / "model")
