"""The epoch's sample order over blended sources, built in seconds, shared as a memory map, read at any sample.

Order rule 2 (a blend of several sources; one source's order is its ``source_stream``, as before):

* Each source walks through its own passes (``source_stream`` with salt ``(source, pass)``, a new pass each time one
  is used up: small sources upsampled, large ones subsampled), as under rule 1.
* The draws come in rounds of ``BLEND_ROUND``. How many of a round's draws each source gets is the weights' share
  with the remainder carried over (exact integer arithmetic): every source stays within one draw of its share at
  every round boundary.
* Inside a round the draws are in a permutation seeded by ``(seed, epoch, ROUND_SALT, round)``.

Rule 1 (``neva.data.sampler.blend_choices``: Megatron's draw-by-draw "furthest behind its share") costs a Python
step per draw and source (39 s for 4 M samples over 10 sources); rule 2 costs a few numpy passes over the epoch,
and any sample is found from its round alone (resume is O(1)). ``StreamingBatchSampler`` records the rule in its
state and refuses to resume a blend written under rule 1 (its order would differ).

The plan of an epoch is the sources' streams (one index per draw, grouped by source) and the cumulative draws of
every source at every round boundary. With a ``cache_dir`` the first process writes them as ``.npy`` files named by a
hash of everything the order depends on, and every process (every rank of the job) memory-maps the same files.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from neva.data.source_stream import SourceLayout, source_size, source_stream

ORDER_RULE = 2
BLEND_ROUND = 1 << 16  # draws per round: a resumed rank permutes one round (about a millisecond)
ROUND_SALT = 1 << 63  # no source index: keeps the rounds' seeds apart from the sources' (seed, epoch, d, pass)
_WEIGHT_SCALE = 1 << 40  # integer weights: the allocation is exact and the same on every machine
_WAIT_S = 3600.0  # how long a process waits for another one's build


def integer_weights(sizes: Sequence[int], weights: Sequence[float] | None) -> np.ndarray:
    """The weights (sizes when None) as integers summing to ``_WEIGHT_SCALE``.

    Raises:
        ValueError: a source with weight but no samples, or no positive weight.
    """
    w = np.asarray(sizes if weights is None else weights, dtype=np.float64)
    for d, (size, weight) in enumerate(zip(sizes, w)):
        if weight > 0 and size == 0:
            raise ValueError(f"blend source {d} has weight but no samples")
    if not (w > 0).any():
        raise ValueError("a blend needs a source with positive weight")
    scaled = np.floor(w / w.sum() * _WEIGHT_SCALE).astype(np.int64)
    scaled[int(np.argmax(w))] += _WEIGHT_SCALE - int(scaled.sum())
    return scaled


def round_counts(weights: np.ndarray, total: int, round_size: int = BLEND_ROUND) -> np.ndarray:
    """Cumulative draws of every source at every round boundary, shape ``(rounds + 1, sources)``.

    Round r has ``m`` draws; source j is owed ``m · w_j`` plus its carry (in units of 1 / ``_WEIGHT_SCALE``), gets
    the whole draws of that, and the round's remaining draws go to the largest remainders (ties: the lower index).
    """
    rounds = -(-total // round_size)
    out = np.zeros((rounds + 1, len(weights)), dtype=np.int64)
    carry = np.zeros(len(weights), dtype=np.int64)
    for r in range(rounds):
        m = min(round_size, total - r * round_size)
        owed = m * weights + carry
        give = owed // _WEIGHT_SCALE
        rest = owed - give * _WEIGHT_SCALE
        extra = np.argsort(-rest, kind="stable")[: m - int(give.sum())]
        give[extra] += 1
        carry = owed - give * _WEIGHT_SCALE
        out[r + 1] = out[r] + give
    return out


def _index_dtype(total: int) -> type:
    return np.uint32 if total <= np.iinfo(np.uint32).max else np.int64


def fill_streams(
    out: np.ndarray, sources: Sequence[SourceLayout], draws: np.ndarray, seed: int, epoch: int, buffer: int
) -> None:
    """Write source j's ``draws[j]`` next indices (passes of ``source_stream``, offset into the concatenation of
    the sources) to ``out``, source after source."""
    offsets = np.concatenate([[0], np.cumsum([source_size(s) for s in sources], dtype=np.int64)])
    at = 0
    for d, (source, n) in enumerate(zip(sources, draws.tolist())):
        size = int(offsets[d + 1] - offsets[d])
        for cycle in range(-(-n // size) if n else 0):
            take = min(size, n - cycle * size)
            if isinstance(source, (int, np.integer)) and take == size:
                # A whole record-set pass shuffled in place: ``permutation(n)`` is ``shuffle(arange(n))``, the same
                # draws; in the output's (often 4-byte) dtype it skips a temporary and misses the cache less.
                view = np.asarray(out[at : at + size])
                view[:] = np.arange(offsets[d], offsets[d + 1], dtype=out.dtype)
                np.random.default_rng([seed, epoch, d, cycle]).shuffle(view)
            else:
                out[at : at + take] = source_stream(source, seed, epoch, (d, cycle), buffer)[:take] + offsets[d]
            at += take


@dataclass(frozen=True)
class EpochPlan:
    """One epoch's order, read by slices: ``plan[a:b]`` is draws a..b-1 as int64 global indices."""

    streams: np.ndarray  # every draw's index, grouped by source (each source's draws in its stream order)
    counts: np.ndarray  # cumulative draws per source at every round boundary; one column: no blend
    seed: int
    epoch: int
    round_size: int = BLEND_ROUND
    origin: str = "memory"  # "memory", "built" (this process wrote the shared files) or "mapped" (another did)
    # the last round read: a rank reads a round one global batch at a time, so it is permuted once, not per batch
    _last: dict[int, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.streams)

    def round(self, r: int) -> np.ndarray:
        """The draws of round ``r``: each source's next ones, in the round's seeded permutation."""
        if r not in self._last:
            self._last.clear()
            self._last[r] = self._permuted_round(r)
        return self._last[r]

    def _permuted_round(self, r: int) -> np.ndarray:
        first, last = self.counts[r], self.counts[r + 1]
        took = last - first
        base = np.cumsum(self.counts[-1]) - self.counts[-1]  # where each source's draws start in ``streams``
        within = np.cumsum(took) - took
        m = int(took.sum())
        idx = np.repeat(base + first - within, took) + np.arange(m, dtype=np.int64)
        values = np.asarray(self.streams[idx], dtype=np.int64)
        return values[np.random.default_rng([self.seed, self.epoch, ROUND_SALT, r]).permutation(m)]

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise IndexError("an epoch plan is read by contiguous slices")
        if self.counts.shape[1] == 1:  # one source: its stream is the order
            return np.asarray(self.streams[start:stop], dtype=np.int64)
        if start >= stop:
            return np.zeros(0, dtype=np.int64)
        first, last = start // self.round_size, (stop - 1) // self.round_size
        parts = np.concatenate([self.round(r) for r in range(first, last + 1)])
        return parts[start - first * self.round_size : stop - first * self.round_size]


def plan_key(sources: Sequence[SourceLayout], weights: Sequence[float] | None, seed: int, buffer: int) -> str:
    """A file name stem naming everything the order depends on but the epoch (``<stem>-e<epoch>`` per epoch)."""
    h = hashlib.sha256(json.dumps([ORDER_RULE, BLEND_ROUND, seed, buffer, weights]).encode())
    for s in sources:
        h.update(np.asarray(s, dtype=np.int64).tobytes() + b"|")
    return f"order-r{ORDER_RULE}-{h.hexdigest()[:24]}"


def build_plan(
    sources: Sequence[SourceLayout], weights: Sequence[float] | None, seed: int, epoch: int, buffer: int = 0,
    out_dir: Path | None = None, stem: str = "", round_size: int = BLEND_ROUND,
) -> EpochPlan:  # fmt: skip
    """Build the epoch's plan in memory, or as ``<out_dir>/<stem>.{streams,counts}.npy`` (memory-mapped);
    ``round_size`` other than ``BLEND_ROUND`` only in tests (many rounds over few samples)."""
    sizes = [source_size(s) for s in sources]
    total = int(sum(sizes))
    if len(sources) == 1:
        counts = np.asarray([[0], [total]], dtype=np.int64)
    else:
        counts = round_counts(integer_weights(sizes, weights), total, round_size)
    dtype = _index_dtype(total)
    if out_dir is None:
        streams = np.empty(total, dtype=dtype)
    else:
        streams = np.lib.format.open_memmap(out_dir / f"{stem}.streams.npy", mode="w+", dtype=dtype, shape=(total,))
    fill_streams(streams, sources, counts[-1], seed, epoch, buffer)
    if out_dir is not None:
        streams.flush()
        np.save(out_dir / f"{stem}.counts.npy", counts)
    return EpochPlan(streams, counts, seed, epoch, round_size)


def shared_plan(
    sources: Sequence[SourceLayout], weights: Sequence[float] | None, seed: int, epoch: int, buffer: int,
    cache_dir: str | os.PathLike,
) -> EpochPlan:  # fmt: skip
    """The epoch's plan from ``cache_dir``: built there by the first process that asks (an exclusive lock file),
    memory-mapped by all of them. A build is a pure function of the arguments, so a file left by an earlier job
    with the same name is the same plan."""
    origin = "mapped"
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    plan = plan_key(sources, weights, seed, buffer)
    stem = f"{plan}-e{epoch}"
    done = cache / f"{stem}.counts.npy"  # written last: its presence means the streams are complete
    if not done.exists():
        lock = cache / f"{stem}.lock"
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            _wait_for(done, lock)
        else:
            os.close(fd)
            try:
                # checked again under the lock: a process that built it between our first look and the lock's
                # creation has removed its lock already (built once, mapped by every other process)
                if not done.exists():
                    origin = "built"
                    tmp = f"{stem}.tmp{os.getpid()}"
                    build_plan(sources, weights, seed, epoch, buffer, cache, tmp)
                    os.replace(cache / f"{tmp}.streams.npy", cache / f"{stem}.streams.npy")
                    os.replace(cache / f"{tmp}.counts.npy", done)
            finally:
                lock.unlink(missing_ok=True)
            if origin == "built":
                _drop_before(cache, plan, epoch - 1)
    streams = np.load(cache / f"{stem}.streams.npy", mmap_mode="r")
    return EpochPlan(streams, np.load(done), seed, epoch, origin=origin)


def _drop_before(cache: Path, plan: str, epoch: int) -> None:
    """Remove this plan's files of epochs before ``epoch``: every rank has moved past them (ranks change epoch
    together, at the same step), while ``epoch`` itself may still be read by a rank that has not."""
    for path in cache.glob(f"{plan}-e*.npy"):
        if int(path.name[len(plan) + 2 :].split(".", 1)[0]) < epoch:
            path.unlink(missing_ok=True)


def _wait_for(done: Path, lock: Path) -> None:
    """Wait while another process builds the plan (its lock file exists)."""
    deadline = time.monotonic() + _WAIT_S
    while not done.exists():
        if not lock.exists() and not done.exists():
            raise RuntimeError(f"the process building {done.name} stopped without writing it; run again")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{done} not written within {_WAIT_S:g} s (lock {lock})")
        time.sleep(0.2)
