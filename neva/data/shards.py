"""``.tar`` shards (webdataset layout): reading samples by random access, and the sample-count indexes.

Layout: one sample = the tar members sharing a key (webdataset's rule: the key is the member name up to the first dot
of its base name; members of a sample are consecutive): ``KEY.json`` holds the LLaVA record and its ``image`` names
members of the sample (``"KEY.jpg"`` or ``["KEY.0.jpg", "KEY.1.png"]``), its ``video`` too (``"KEY.video.mp4"`` or
``["KEY.video.0.mp4", ...]``, decoded from the member's bytes by the folder's decoder, ``neva.data.video_decode``).
``SHARD.idx.json`` next to a shard (written by ``python -m neva.data.make_shards``) stores its sample count so that
nothing is read to plan an epoch.

Design: shards are read with random access (stdlib ``tarfile`` over a seekable file, grouping members exactly as
``webdataset.tariterators.group_by_keys`` does) as a map-style dataset whose global index is (shard, position); the
*order* (``neva.data.stream_sampler``) does the streaming, visiting one shard at a time.
Why not ``webdataset.WebDataset``: its sequential stream has to read every byte of every shard on every
data-parallel rank (each rank needs only its micro-batch of each global batch) and cannot start at sample k. Here a
rank extracts only its own samples (the members of the others are skipped by seeking over them), and a resumed run
never opens the shards it has finished and reads only member headers of the shard it resumes in.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import tarfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from webdataset.tariterators import base_plus_ext

from neva.constants import MAX_IMAGE_PIXELS
from neva.data.dataset import EncoderSettings, SkipLogger, is_skipped, process_record
from neva.data.front_ends import FrontEnd
from neva.data.images import ImageError, ImageSource, decode_image, safe_relative_path
from neva.data.records import ERROR_KEY, expand_shard_spec, parse_record
from neva.data.video import VideoSource, as_video_error, check_video_bytes
from neva.data.video_decode import DecodedVideo, decode_video

log = logging.getLogger(__name__)

INDEX_SUFFIX = ".idx.json"
_SKIP_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta: ``__key__``-style entries are not sample data


@dataclass
class ShardSample:
    """The members of one sample: ``suffix`` (lower-cased, as webdataset) → tar header."""

    key: str
    members: dict[str, tarfile.TarInfo] = field(default_factory=dict)


def group_members(members: Sequence[tarfile.TarInfo]) -> list[ShardSample]:
    """Tar members → samples, with webdataset's ``group_by_keys`` rules.

    Consecutive members with the same key form a sample; directories, ``__meta__`` entries and names without an
    extension are ignored. A repeated suffix within a sample keeps the first member (webdataset would stop the
    whole shard; one odd sample must not).
    """
    samples: list[ShardSample] = []
    for info in members:
        if not info.isreg() or _SKIP_META.match(info.name):
            continue
        key, suffix = base_plus_ext(info.name)
        if key is None:
            continue
        if not samples or samples[-1].key != key:
            samples.append(ShardSample(key))
        samples[-1].members.setdefault(suffix.lower(), info)
    return samples


def open_shard(path: str) -> tuple[tarfile.TarFile, list[ShardSample]]:
    """Open a shard for random access and index its samples (reads the member headers only).

    Raises:
        RuntimeError: the file is not a readable tar (truncated or not a tar).
    """
    try:
        tar = tarfile.open(path, "r:")  # noqa: SIM115 (kept open while its samples are being read)
        return tar, group_members(tar.getmembers())
    except (tarfile.TarError, OSError) as exc:
        raise RuntimeError(f"shard {path} cannot be read as a tar: {exc}") from exc


def index_path(shard: str) -> str:
    """``/data/x-000001.tar`` → ``/data/x-000001.idx.json``."""
    return shard[: -len(".tar")] + INDEX_SUFFIX if shard.endswith(".tar") else shard + INDEX_SUFFIX


def write_index(shard: str, num_samples: int) -> None:
    """Write the sidecar index; the shard's byte size in it tells a stale index from a valid one."""
    with open(index_path(shard), "w") as f:
        json.dump({"num_samples": num_samples, "shard_bytes": os.path.getsize(shard)}, f)


def count_samples(shard: str) -> int:
    """Samples in a shard: from its index when it matches the shard's size, else by reading the member headers."""
    try:
        with open(index_path(shard)) as f:
            index = json.load(f)
        if int(index["shard_bytes"]) == os.path.getsize(shard):
            return int(index["num_samples"])
        log.warning("%s does not match %s (size changed); counting its samples", index_path(shard), shard)
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable %s: %s", index_path(shard), exc)
    tar, samples = open_shard(shard)
    tar.close()
    return len(samples)


def _find_member(sample: ShardSample, name: str, shard: str) -> tarfile.TarInfo:
    """The member of ``sample`` a record names ``KEY.suffix``.

    Raises:
        ImageError: ``unsafe_image_path`` (an absolute or escaping name) or ``missing_image`` (no such member).
    """
    key, suffix = base_plus_ext(safe_relative_path(name))
    # The bare key also matches when the shard keeps keys under a directory (``dir/KEY.jpg`` members).
    ok = key is not None and key in (sample.key, os.path.basename(sample.key))
    info = sample.members.get(suffix.lower()) if ok else None
    if info is None:
        raise ImageError("missing_image", f"{name} is not a member of sample {sample.key} in {shard}")
    return info


class _MemberImages(ImageSource):
    """A sample's image members; the record names them ``KEY.suffix``."""

    def __init__(
        self, tar: tarfile.TarFile, sample: ShardSample, shard: str, lock: threading.Lock, max_pixels: int
    ) -> None:
        self.tar, self.sample, self.shard, self.lock, self.max_pixels = tar, sample, shard, lock, max_pixels

    def load(self, name: str) -> Image.Image:
        info = _find_member(self.sample, name, self.shard)
        with self.lock:
            data = self.tar.extractfile(info).read()
        return decode_image(data, name, self.max_pixels)


class _MemberVideos:
    """A sample's video members (named ``KEY.suffix`` as images are), decoded as ``VideoSource`` decodes a folder's
    files: the byte cap from the member's header, then the same decoder, caps and skip reasons. A member is read
    whole (under the byte cap), so the decoder's seeks never move the shard's shared file offset."""

    def __init__(
        self, videos: VideoSource, tar: tarfile.TarFile, sample: ShardSample, shard: str, lock: threading.Lock
    ) -> None:
        self.videos, self.tar, self.sample, self.shard, self.lock = videos, tar, sample, shard, lock

    def load(self, name: Any) -> DecodedVideo:
        """The sampled frames of the member ``name``. Raises ``VideoError``."""
        try:
            info = _find_member(self.sample, name, self.shard)
        except ImageError as exc:
            raise as_video_error(exc) from exc
        check_video_bytes(info.size, name, self.videos.limits)
        with self.lock:
            data = self.tar.extractfile(info).read()
        return decode_video(io.BytesIO(data), name, self.videos.limits)

    def pixels(self, video: DecodedVideo) -> torch.Tensor:
        return self.videos.pixels(video)


class ShardDataset(Dataset):
    """Map-style view of a list of shards: index = shard offset + position of the sample in the shard.

    Reads are efficient when consecutive indices come from the same shard (``neva.data.stream_sampler``'s order): one
    shard is open per process at a time, reopened after a fork since DataLoader workers would share the offset.

    Args:
        shards: shard paths.
        counts: samples per shard (``count_samples``).
        settings: tokenizer/template settings (as for JSON records).
        front_end: the model's vision front end (``neva.data.front_ends``).
        max_pixels: ``model.data.max_image_pixels``.
        video_source: the video caps and the tower's frame fit (its folder is not read: videos are members), or
            None for a model without video.
    """

    def __init__(
        self,
        shards: Sequence[str],
        counts: Sequence[int],
        settings: EncoderSettings,
        front_end: FrontEnd,
        max_pixels: int = MAX_IMAGE_PIXELS,
        video_source: VideoSource | None = None,
    ) -> None:
        self.shards = list(shards)
        self.video_source = video_source
        self.max_pixels = max_pixels
        self.counts = [int(c) for c in counts]
        self.offsets = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)])
        self.settings = settings
        self.front_end = front_end
        self._log = SkipLogger()
        self._lock = threading.Lock()
        self._pid = -1
        self._current: tuple[int, tarfile.TarFile, list[ShardSample]] | None = None

    @classmethod
    def from_spec(
        cls,
        spec: str,
        settings: EncoderSettings,
        front_end: FrontEnd,
        max_pixels: int = MAX_IMAGE_PIXELS,
        video_source: VideoSource | None = None,
    ) -> ShardDataset:
        """Shards named by a path or brace pattern.

        Raises:
            ValueError: the shards hold no sample.
        """
        shards = expand_shard_spec(spec)
        counts = [count_samples(s) for s in shards]
        if sum(counts) == 0:
            raise ValueError(f"model.data.data_path entry {spec!r}: its {len(shards)} shard(s) hold no sample")
        return cls(shards, counts, settings, front_end, max_pixels, video_source)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """Global index → (shard number, position in the shard)."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} outside {len(self)} shard samples")
        shard = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return shard, index - int(self.offsets[shard])

    def __getitem__(self, index: int) -> dict[str, Any]:
        shard, pos = self.locate(int(index))
        tar, samples = self._shard(shard)
        sample = samples[pos]
        path = self.shards[shard]
        default_id = f"{os.path.basename(path)}:{sample.key}"
        info = sample.members.get("json")
        if info is None:
            record = {"id": default_id, ERROR_KEY: "malformed_json", "detail": f"no {sample.key}.json in {path}"}
        else:
            with self._lock:
                raw = tar.extractfile(info).read()
            record = parse_record(raw, default_id)
        images = _MemberImages(tar, sample, path, self._lock, self.max_pixels)
        videos = None if self.video_source is None else _MemberVideos(self.video_source, tar, sample, path, self._lock)
        out = process_record(record, self.settings, images, self.front_end, videos)
        if is_skipped(out):
            self._log(out)
        return out

    def _shard(self, shard: int) -> tuple[tarfile.TarFile, list[ShardSample]]:
        with self._lock:
            if self._pid != os.getpid() or self._current is None or self._current[0] != shard:
                if self._current is not None and self._pid == os.getpid():
                    self._current[1].close()
                tar, samples = open_shard(self.shards[shard])
                if len(samples) != self.counts[shard]:
                    tar.close()
                    # The order was planned with the old count: reading on would silently shift every sample.
                    raise RuntimeError(
                        f"{self.shards[shard]} holds {len(samples)} samples, {self.counts[shard]} were counted "
                        "when the run started; the shard changed during the run (or its .idx.json is wrong)"
                    )
                self._current, self._pid = (shard, tar, samples), os.getpid()
            return self._current[1], self._current[2]

    def layout(self) -> list[int]:
        """Sample counts per shard, for ``neva.data.stream_sampler.stream_order``."""
        return list(self.counts)

    def modality_lengths(self) -> list[int]:
        """Not available: it would need every record read before training."""
        raise NotImplementedError("group_by_modality_length is not supported with .tar shards")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_current=None, _pid=-1, _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
