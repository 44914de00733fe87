"""What every step of a layout does, decided once from the layout: the engine runs these decisions, the planner counts
them (``neva.training.engine.Engine``, ``neva.planner.activations``). Before this object each side wrote its own
expression, and they drifted (the learned-positions head was ``tp == 1`` in one and ``tp > 1 or pp > 1`` in the
other; the planner kept a native tower's whole micro-batch on every context-parallel rank after the split began
sharing it out).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neva.models.attention import attends_per_segment
from neva.parallel.layout import Layout
from neva.parallel.tensor_parallel import vocab_parallel_logits


@dataclass(frozen=True)
class StepDecisions:
    """A step's decisions under one layout.

    Attributes:
        sp_multiple: every micro-batch's length (each cp rank's columns under context parallelism) is padded to a
            multiple of it: the tensor-parallel size under sequence parallelism, which splits the sequence over the
            tp ranks; else 1.
        learned_only_head: the LM head runs at the learned positions only (``output_positions``), not at every
            position: without TP (selecting positions of a sequence- or vocab-sharded activation would need a
            collective) and without PP (the pipeline's stages pass fixed ``[B, S]`` shapes and its last stage takes
            the loss of every position).
        vocab_parallel: the logits stay vocab-sharded for the loss (``loss_parallel``): TP without PP.
        cp: the context-parallel size: each rank holds ``1 / cp`` of every row and encodes a share of the tower
            inputs (``tower_inputs``).
    """

    sp_multiple: int
    learned_only_head: bool
    vocab_parallel: bool
    cp: int

    @classmethod
    def of(cls, layout: Layout) -> StepDecisions:
        return cls(
            sp_multiple=layout.tp if layout.sp else 1,
            learned_only_head=layout.tp == 1 and layout.pp == 1,
            vocab_parallel=vocab_parallel_logits(layout.tp, layout.pp),
            cp=layout.cp,
        )

    def join_rows(self, packed: bool, device: torch.device) -> bool:
        """Packed rows are joined into one row of their real tokens (``neva.data.micro_batch.MicroBatch.joined``: the same loss
        without the rows' padding) where the head runs at learned positions and the device attends per segment."""
        return packed and self.learned_only_head and attends_per_segment(device)

    def tower_inputs(self, n: int) -> int:
        """The most of a micro-batch's ``n`` tower inputs that one cp rank encodes: all ``n`` without context
        parallelism, else ``ceil(n / cp)``. Fixed-resolution images, AnyRes tiles and video frames are dealt out by
        count, the remainder to one rank more (``ContextShard.share_sizes``); a native-resolution tower's items
        whole, by patches (``native_shares``), which for items of one size is the same count. Which rank takes the
        remainder rotates from micro-batch to micro-batch; this is the busiest rank's share, what its memory holds."""
        return -(-n // self.cp)
