"""What the model sees besides text: one structure, per modality one ``MediaInputs``, the same for every producer.

A fixed-size image, an AnyRes image's tiles and a video's frames are all tower inputs whose projected features are
written into the decoder's sequence at known positions. Each producer (the collator, generation, the rehearsal's fake
batches, a test) builds the same shape: the tower inputs, the ``[M, 2]`` (row, column) positions the features go to in
feature order, and, where the features are laid out rather than flattened, the AnyRes index (and pooling weights).
The model (``NevaModel.embed``) takes one ``Media`` and the engine, the pipeline's first stage and generation hand it
on unchanged, as the collated batch's ``media`` (``neva.data.collate``).

Every micro-batch runs the same modules: a modality a micro-batch does not carry runs as an empty one
(``MediaInputs.empty``) while gradients are recorded, so a trainable tower, projector or AnyRes newline takes part in
every backward with zero gradients, and data-parallel ranks (DDP's buckets, FSDP's reduce-scatters, the gradient
all-reduce of EP and PP replicas) stay matched when one rank's micro-batch is text only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.utils._pytree as pytree

MODALITIES = ("image", "video")


@dataclass
class MediaInputs:
    """One modality's tower inputs and where their features go.

    Attributes:
        pixels: ``[N, C, H, W]`` tower inputs (images, AnyRes tiles or video frames), uint8 (normalised by the tower)
            or already-normalised float; in row order, then position order.
        positions: ``[M, 2]`` (row, column) of every feature position in the order the features fill them, found on
            the host (the splice is then an index op, no host-device sync); None: found here from the token ids
            (serving), checked against ``items_per_row`` / ``tokens``.
        items_per_row: ``[B]`` images (or videos) per row; used to check positions found from ids.
        tokens: ``[K]`` positions of each item where they vary (AnyRes); None: each takes the model's fixed count.
        index: AnyRes: ``[M]`` row of the flattened tower features for each position (-1 the learned newline), or
            ``[M, 4]`` bilinear taps under ``anyres_max_N`` with ``weight`` ``[M, 4]``.
        weight: see ``index``.
        frames: video: ``[V]`` frames of each video (the splice needs only the positions).
        grid: patch-grid towers (their family's ``patch_grid``): ``[N, 3]`` (t, h, w) patches of each item, whose
            patches ``pixels`` holds flattened (``[L, C·T·P·P]``, the items' patches one after another); None: every
            tower input is one fixed-size image.
        feature_rows: ``[M]`` the row of the encoded features (those of the tower inputs given) that each position
            takes; None: one row per position, in order. Rows that hold the same items then encode them once: a
            preference pair's chosen and rejected rows share the prompt's images (``neva.data.preference``).
    """

    pixels: torch.Tensor
    positions: torch.Tensor | None = None
    items_per_row: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    index: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    frames: torch.Tensor | None = None
    grid: torch.Tensor | None = None
    feature_rows: torch.Tensor | None = None

    @property
    def is_empty(self) -> bool:
        return self.pixels.shape[0] == 0

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MediaInputs:
        # The grid stays on the host: the tower reads it as integers (from a device copy, a sync per micro-batch).
        moved = self._map(lambda t: t.to(device, non_blocking=non_blocking))
        return replace(moved, grid=self.grid)

    def pin_memory(self) -> MediaInputs:
        """Pinned host copies (the DataLoader calls this on CUDA runs, as it pins a batch's plain tensors)."""
        return self._map(torch.Tensor.pin_memory)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MediaInputs:
        return MediaInputs(**{f.name: None if (v := getattr(self, f.name)) is None else fn(v) for f in fields(self)})

    def padded_rows(self, rows: int) -> MediaInputs:
        """The same inputs for a batch padded to ``rows`` rows (the added rows hold no item)."""
        counts = self.items_per_row
        if counts is None or counts.shape[0] >= rows:
            return self
        return replace(self, items_per_row=torch.cat([counts, counts.new_zeros(rows - counts.shape[0])]))

    @staticmethod
    def empty(pixels: torch.Tensor, anyres: bool = False, grid: bool = False) -> MediaInputs:
        """No item: the tower's empty input (``pixels``, zero rows), zero positions (and an empty AnyRes index, or an
        empty ``grid`` for a patch-grid tower)."""
        device = pixels.device
        return MediaInputs(
            pixels=pixels,
            positions=torch.zeros(0, 2, dtype=torch.long, device=device),
            index=torch.zeros(0, dtype=torch.long, device=device) if anyres else None,
            grid=torch.zeros(0, 3, dtype=torch.long, device=device) if grid else None,
        )


@dataclass
class Media:
    """Every modality of one micro-batch (None: the micro-batch carries none of it)."""

    image: MediaInputs | None = None
    video: MediaInputs | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Media:
        return Media(**{m: None if v is None else v.to(device, non_blocking) for m, v in self.items()})

    def pin_memory(self) -> Media:
        return Media(**{m: None if v is None else v.pin_memory() for m, v in self.items()})

    def items(self) -> list[tuple[str, MediaInputs | None]]:
        return [(m, getattr(self, m)) for m in MODALITIES]

    def padded_rows(self, rows: int) -> Media:
        return Media(**{m: None if v is None else v.padded_rows(rows) for m, v in self.items()})

    def joined(self, remap: Callable[[torch.Tensor], torch.Tensor]) -> Media:
        """The same media for the batch's rows joined into one (``neva.data.micro_batch.MicroBatch.joined``): every ``[M, 2]``
        position through ``remap``, items per row summed."""
        out = {}
        for m, v in self.items():
            if v is not None:
                per_row = None if v.items_per_row is None else v.items_per_row.sum().reshape(1)
                positions = None if v.positions is None else remap(v.positions)
                v = replace(v, positions=positions, items_per_row=per_row)
            out[m] = v
        return Media(**out)

    def tower_inputs(self, modality: str) -> int:
        """Tower passes of ``modality`` in this micro-batch (images or tiles, frames): the FLOP model's count."""
        inputs = getattr(self, modality)
        return 0 if inputs is None else inputs.pixels.shape[0]


@dataclass
class GeneratedText(Media):
    """A decoding step's media: none, its ids generated text. A media token among them (a model may generate its own
    image token: llava-hf and Qwen-VL checkpoints give it a vocabulary row) is its embedding, as transformers embeds
    it while decoding, not a place for features: the model does not refuse it (``NevaModel.embed``)."""


# Pipeline stages flatten their keyword inputs with torch's pytree: as registered nodes, the tensors inside a Media
# are seen (moved, detached for the stage's backward bookkeeping) like any tensor input.
pytree.register_dataclass(MediaInputs)
pytree.register_dataclass(Media)
pytree.register_dataclass(GeneratedText)


def image_media(pixels: torch.Tensor, items_per_row: torch.Tensor | None = None, **fields: Any) -> Media:
    """A ``Media`` of images only, from the tensors at hand (serving, scripts and tests); ``fields``: the other
    ``MediaInputs`` fields (positions, tokens, index, weight)."""
    return Media(image=MediaInputs(pixels, items_per_row=items_per_row, **fields))
