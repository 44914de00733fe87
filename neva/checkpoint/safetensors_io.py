"""Streaming safetensors I/O shared by the neva format and the HF exporter.

Writing takes ``(key, tensor)`` pairs one at a time and flushes a shard as soon as it would exceed the size limit, so
at most one shard's worth of tensors is buffered; reading opens one file at a time with ``safe_open`` (memory-mapped),
so a caller that consumes tensors one by one never holds the whole checkpoint. Shard names and the index follow the HF
convention (``model-00001-of-00003.safetensors`` + ``model.safetensors.index.json``), which transformers loads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from neva.errors import InputError

DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
"""Shard size limit (HF's historical "5GB" default)."""

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    # safetensors refuses tensors that share storage (views, tied weights) and non-contiguous ones; a copy is cheap
    # compared with failing at the end of a long conversion.
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


class ShardWriter:
    """Writes tensors into HF-style safetensors shards as they arrive.

    Shards are written under temporary names and renamed once their count is known (``close``). A single shard is
    called ``model.safetensors`` and gets no index.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._seen: set[str] = set()
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Buffer one tensor; flushes the current shard first if this tensor would overflow it."""
        if key in self._seen:
            raise ValueError(f"duplicate tensor key {key!r}")
        self._seen.add(key)
        tensor = _own_storage(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[key] = tensor
        self._buffer_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        path = self.directory / f".shard-{len(self._shards):05d}.tmp"
        save_file(self._buffer, str(path), metadata=self.metadata)
        self._shards.append((path, list(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    def close(self) -> list[str]:
        """Flush, give the shards their final names, write the index if sharded; returns the file names."""
        if self._buffer or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            names = [WEIGHTS_NAME]
        else:
            names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (path, keys), name in zip(self._shards, names):
            path.rename(self.directory / name)
            weight_map.update(dict.fromkeys(keys, name))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return names


def write_safetensors(
    directory: str | os.PathLike,
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Write ``(key, tensor)`` pairs into (sharded) safetensors files in ``directory``; returns the file names."""
    writer = ShardWriter(directory, max_shard_bytes, metadata)
    for key, tensor in tensors:
        writer.add(key, tensor)
    return writer.close()


def safetensors_files(directory: str | os.PathLike) -> list[Path]:
    """The weight files of a directory: the index's shards in order, or the single ``model.safetensors``.

    Raises:
        FileNotFoundError: neither an index nor ``model.safetensors`` exists.
    """
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.is_file():
        return index_files(index)
    single = directory / WEIGHTS_NAME
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {directory}")


def index_files(index: Path) -> list[Path]:
    """The weight files a ``*.index.json`` names (each once, in order), all inside the index's own directory.

    Raises:
        ValueError: no ``weight_map``, or a file name that leaves the directory (absolute, or with ``..``).
    """
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: no weight_map of tensor name -> file name")
    names = list(dict.fromkeys(weight_map.values()))
    for name in names:
        path = PurePosixPath(name)
        if not name or path.is_absolute() or ".." in path.parts or "\\" in name:
            raise ValueError(f"{index}: weight file {name!r} is outside the index's directory; refusing to read it")
    return [index.parent / name for name in names]


def _open(path: str | os.PathLike) -> Any:
    """``safe_open`` of a weight file; one whose header is not safetensors' is an ``InputError`` naming it (the
    library's message does not)."""
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as err:
        raise InputError(f"{path}: not a readable safetensors file ({err})") from err


def iter_safetensors(files: Iterable[str | os.PathLike]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, tensor)`` from each file in turn; each tensor is read only when its turn comes."""
    for path in files:
        with _open(path) as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                yield key, f.get_tensor(key)


def safetensors_shapes(files: Iterable[str | os.PathLike]) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape (headers only; no tensor data is read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with _open(path) as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes
