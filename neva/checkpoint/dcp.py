"""Sharded training checkpoints with ``torch.distributed.checkpoint`` (DCP), independent of the layout.

Keys are the plain model names (``llm.layers.3.attention.wq.weight``) whatever wraps the parameters (FSDP2, DTensor
TP shards, pipeline stages, activation checkpointing, compile), and optimizer state is stored per parameter under
``<name>.<state>`` (``exp_avg``, ``exp_avg_sq``, ``step``). DCP records each tensor's global shape and the piece
every rank wrote, so a checkpoint saved under one layout loads into any other: each rank reads the pieces its own
shards need.

Each rank hashes the files it writes as the bytes go out (for the checkpoint's manifest, ``neva.checkpoint.verified``),
and DCP's ``.metadata`` (a pickle) is read by an unpickler that admits only DCP's own metadata classes.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import StorageMeta

from neva.checkpoint.verified import CheckpointError, HashingWriter

Named = list[tuple[str, torch.Tensor]]  # (plain name, the tensor a checkpoint stores for that parameter)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state (zeros, sharded like each parameter) so a load has tensors to fill in place."""
    for group in optimizer.param_groups:
        # Where torch's AdamW keeps ``step``: on the parameter's device for the fused (CUDA) and capturable kernels.
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            if optimizer.state.get(p):
                continue
            optimizer.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                "exp_avg": torch.zeros_like(p.data, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p.data, memory_format=torch.preserve_format),
            }


def optimizer_state(named: Named, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Optimizer state under ``<plain parameter name>.<key>``."""
    out = {}
    for name, p in named:
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"{name}.{key}"] = value
    return out


def save(path: str | Path, named: Named, optimizer: torch.optim.Optimizer | None) -> dict[str, dict[str, Any]]:
    """Write this rank's parameters ``named`` (sharded as they are) and their optimizer state into directory
    ``path`` (a collective); returns the digests of the files this rank wrote, by name."""
    state = {"model": {name: p.data for name, p in named}}
    if optimizer is not None:
        state["optim"] = optimizer_state(named, optimizer)
    writer = FileSystemWriter(str(path))
    writer.fs = _HashingFileSystem()
    dcp.save(state, storage_writer=writer)
    return writer.fs.digests


def load(path: str | Path, named: Named, optimizer: torch.optim.Optimizer | None) -> None:
    """Fill ``named`` and their optimizer state in place from directory ``path``, whatever layout wrote it (a
    collective; DCP casts to each tensor's dtype)."""
    state = {"model": {name: p.data for name, p in named}}
    if optimizer is not None:
        init_optimizer_state(optimizer)
        state["optim"] = optimizer_state(named, optimizer)
    reader = _SafeReader(str(path))
    reader.read_metadata()  # here, so that a refusal surfaces as itself, not wrapped in DCP's collective errors
    dcp.load(state, storage_reader=reader)


class _HashingFileSystem(FileSystem):
    """DCP's local file system, hashing every file written (renames of its temp files followed)."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, dict[str, Any]] = {}

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = HashingWriter(stream)
            yield hashing
            self.digests[Path(path).name] = hashing.digest()

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)
        if Path(path).name in self.digests:
            self.digests[Path(new_path).name] = self.digests.pop(Path(path).name)


# What DCP's .metadata pickle refers to (torch 2.x): its metadata dataclasses, torch.Size, dtypes and layouts, paths.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "Path"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of DCP metadata")


class _SafeReader(FileSystemReader):
    """DCP's reader with ``.metadata`` unpickled under an allowlist: a planted payload is refused, not run."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as err:
            raise CheckpointError(f"{path}: refused to load DCP metadata ({err}); neva never writes that") from err
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
