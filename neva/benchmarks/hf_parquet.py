"""Reading a benchmark's Hugging Face dataset snapshot on local disk: the split's parquet files (what
``huggingface-cli download --repo-type dataset`` puts on disk), images embedded as ``datasets``' ``Image`` feature (a
``{bytes, path}`` struct), read with ``pyarrow``.

A row's plain columns are read at once; its images stay in the files until its question is asked (``ParquetImage``):
a benchmark's decoded images would not fit in memory.
"""

from __future__ import annotations

import dataclasses
import functools
import io
from pathlib import Path
from typing import Any

from PIL import Image

from neva.benchmarks.files import MissingFile
from neva.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ParquetImage:
    """One image cell of a parquet file, decoded only when its question is asked."""

    path: Path
    row_group: int
    row: int  # within the row group
    column: str

    def open(self) -> Image.Image:
        """Raises OSError (not an image)."""
        cell = _row_group_column(self.path, self.row_group, self.column)[self.row]
        data = cell.get("bytes") if isinstance(cell, dict) else cell
        if not data:
            raise OSError(f"{self.path}: row group {self.row_group}, row {self.row}: no image bytes in {self.column}")
        return Image.open(io.BytesIO(data)).convert("RGB")

    def __str__(self) -> str:
        return f"{self.path}[{self.column}, row group {self.row_group}, row {self.row}]"


@functools.lru_cache(maxsize=2)  # questions are asked in file order: one row group's images decoded at a time
def _row_group_column(path: Path, row_group: int, column: str) -> list[Any]:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).read_row_group(row_group, columns=[column]).column(0).to_pylist()


def split_files(folder: Path, split: str, subset: str = "", also: tuple[str, ...] = ()) -> list[Path]:
    """The parquet files of ``split`` under ``folder/subset`` (any depth: ``data/``, a config's folder): named
    ``<split>-NNNNN-of-NNNNN.parquet``, ``<split>.parquet`` or one of ``also`` (a dataset card naming its file
    otherwise), in path order (the dataset's row order).

    Raises:
        MissingFile: none there.
    """
    root = folder / subset if subset else folder
    names = (f"{split}.parquet", *also)
    files = sorted(
        p for p in root.rglob("*.parquet") if p.name in names or p.name.startswith(f"{split}-")
    ) if root.is_dir() else []  # fmt: skip
    if not files:
        raise MissingFile(f"no {split} parquet file ({split}-*.parquet{''.join(', ' + n for n in names)}) under {root}")
    return files


def is_image_type(field: Any) -> bool:
    """``datasets``' ``Image`` feature as parquet stores it: a struct with a binary ``bytes`` field."""
    import pyarrow as pa

    return pa.types.is_struct(field.type) and any(f.name == "bytes" for f in field.type)


def read_rows(files: list[Path]) -> list[dict[str, Any]]:
    """Every row of ``files`` in order: plain columns as Python values, each image column as a ``ParquetImage`` (not
    read: an empty cell refuses to open, its question a counted skip).

    Raises:
        ConfigError: a file that is not parquet (named).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for path in files:
        try:
            parquet = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as err:
            raise ConfigError(f"{path} is not a parquet file ({err})") from None
        schema = parquet.schema_arrow
        images = [f.name for f in schema if is_image_type(f)]
        plain = [f.name for f in schema if f.name not in images]
        for group in range(parquet.num_row_groups):
            for i, row in enumerate(parquet.read_row_group(group, columns=plain).to_pylist()):
                rows.append({**row, **{c: ParquetImage(path, group, i, c) for c in images}})
    return rows
