"""The training model of any layout as ``neva.models.generation.generate`` calls a model: evaluation during training
runs the weights being trained, never a second copy.

``generate`` needs ``cfg``, ``parameters()``, ``new_cache(batch, length)`` and a forward whose ``[:, -1]`` are each
row's next-token logits. ``LayoutGenerationModel`` gives those for this rank's parts:

- one process, DDP: the model itself (DDP's wrapper is bypassed: it would hook the forward for gradient syncs);
- FSDP2: the sharded model; each forward gathers its parameters (a collective of the data-parallel ranks, so every
  data-parallel rank must run the same forwards: ``shares_questions`` is False; so with expert parallelism);
- tensor parallel: the sharded model; each rank caches its own heads' keys and values, vocabulary-sharded logits are
  gathered for the last position only;
- sequence parallelism: the blocks split every forward's positions evenly over the tensor-parallel ranks, which a
  decoding step's one position (or a prompt of any length) cannot be. Each forward is right-padded to the
  tensor-parallel multiple with filler tokens after the real ones; causal attention keeps them out of every real
  position's result, their logits are dropped, and each KV cache's length is set back so the next forward overwrites
  their keys and values. A linear-attention layer's recurrent state would take them in: refused (``check_generation_layout``);
- pipeline parallel: the stages run in chunk order, each with a KV cache for its own layers, passing hidden states
  point to point (dtype first, then the tensor); the last stage's last-position logits are broadcast to every
  pipeline rank, so all of them choose the same tokens and stop together. The same layer computations as the
  unsplit model with its KV cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from neva.errors import ConfigError
from neva.models.config import NevaConfig
from neva.models.llama import KVCache, new_layer_caches
from neva.models.media import Media
from neva.parallel.layout import Layout
from neva.parallel.parallelize import ParallelModel
from neva.parallel.step_decisions import StepDecisions

# Hidden states between stages: their dtype is sent first as an index here (autocast and O2 decide it per layer).
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_generation_layout(cfg: NevaConfig, layout: Layout) -> None:
    """Raises: ConfigError where a model cannot generate under its layout: sequence parallelism with linear-attention
    layers (the padding after a forward's real positions would enter their recurrent state). A start-time rule of a
    run that generates (``neva.parallel.run_rules.check_run``), and this module's own guard."""
    if StepDecisions.of(layout).sp_multiple > 1 and cfg.llm.linear_attention is not None:
        raise ConfigError(
            "generation under model.sequence_parallel=true is not built for linear-attention layers (the padding to "
            "the tensor-parallel multiple would enter their recurrent state): set model.sequence_parallel=false"
        )


class LayoutGenerationModel:
    """``generate``'s model for this rank's share of the training model (see the module docstring).

    Args:
        parallel: the training engine's parallelized model.
        autocast: the forward's context (the run's bf16 autocast), or None.
    """

    def __init__(self, parallel: ParallelModel, autocast: Callable[[], Any] | None = None) -> None:
        self.parallel = parallel
        self.parts = parallel.parts
        self.cfg = self.parts[0].cfg
        self.autocast = autocast or contextlib.nullcontext
        layout = parallel.layout
        self.tp = layout.tp
        self.pp_group = parallel.group("pp")
        self.num_chunks = layout.num_chunks
        self.chunk_ids = [0] if parallel.runner is None else list(parallel.runner.chunk_ids)
        check_generation_layout(self.cfg, layout)
        self.sp_multiple = StepDecisions.of(layout).sp_multiple
        # the filler of the sequence-parallel padding: any text id (a media placeholder would ask for features)
        self.filler = min({0, 1, 2} - {self.cfg.image_token_id, self.cfg.video_token})

    @property
    def shares_questions(self) -> bool:
        """Whether each data-parallel replica may answer its own questions: not when a forward is a collective over
        the data-parallel ranks (FSDP2 gathers the sharded parameters in every forward; expert parallelism, carved
        from the data-parallel ranks, exchanges tokens all-to-all in every MoE layer)."""
        fsdp = any(isinstance(m, FSDPModule) for part in self.parts for m in part.modules())
        return not fsdp and self.parallel.layout.ep == 1

    def parameters(self):
        return self.parts[0].parameters()

    def new_cache(self, batch_size: int, max_len: int) -> list[list[KVCache]]:
        """One cache per local chunk, for its own layers (under TP, its own key/value heads), with room for the
        sequence-parallel padding of the last forward."""
        llm = self.cfg.llm
        max_len += self.sp_multiple - 1
        caches = []
        for part in self.parts:
            param = next(part.llm.layers.parameters())
            local = param.to_local() if isinstance(param, DTensor) else param
            dtype = self._activation_dtype(local.dtype, local.device)
            layers = list(part.llm.layers.keys())
            heads = llm.num_kv_heads // self.tp
            caches.append(new_layer_caches(llm, layers, batch_size, max_len, heads, local.device, dtype))
        return caches

    def _activation_dtype(self, param_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """The keys' and values' dtype: the autocast dtype when the run autocasts, else the parameters'."""
        with self.autocast():
            return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else param_dtype

    def __call__(
        self,
        input_ids: torch.Tensor,
        media: Media | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        cache: list[list[KVCache]] | None = None,
    ) -> torch.Tensor:
        """Logits (fp32, whole vocabulary) on every rank: with a cache (decoding) the last position's ``[B, 1, V]``,
        without one (a teacher-forced reply's loss, ``Answerer.reply_losses``) every position's ``[B, S, V]``."""
        s = input_ids.shape[1]
        keep = slice(s - 1, s) if cache is not None else slice(0, s)  # the real positions whose logits are asked
        extra = (-s) % self.sp_multiple
        if extra:
            input_ids, position_ids, segment_ids = _right_padded(
                input_ids, position_ids, segment_ids, extra, self.filler
            )
        kw = {"position_ids": position_ids, "segment_ids": segment_ids}
        with self.autocast():
            if self.pp_group is None:
                out = _whole(self.parts[0](input_ids, media, cache=None if cache is None else cache[0], **kw)[:, keep])
            else:
                out = self._through_stages(input_ids, media, cache, kw, keep)
        if extra and cache is not None:  # the filler's keys and values: overwritten by the next forward
            for chunk in cache:
                for layer in chunk:
                    layer.length -= extra
        return out

    def _through_stages(self, input_ids, media, cache, kw, keep: slice) -> torch.Tensor:
        group = self.pp_group
        me = dist.get_rank(group)
        pp = dist.get_world_size(group)
        b, s = input_ids.shape
        device = input_ids.device
        h: torch.Tensor | None = None
        last_holder = (self.num_chunks - 1) % pp
        width = keep.stop - keep.start
        logits = torch.empty(b, width, self.cfg.llm.vocab_size, dtype=torch.float32, device=device)
        for c in range(self.num_chunks):
            owner = c % pp
            if owner != me:
                continue
            k = self.chunk_ids.index(c)
            if c > 0:
                prev = dist.get_global_rank(group, (c - 1) % pp)
                code = torch.zeros(1, dtype=torch.long, device=device)
                dist.recv(code, src=prev, group=group)
                h = torch.empty(b, s, self.cfg.llm.hidden_size, dtype=_DTYPES[int(code)], device=device)
                dist.recv(h, src=prev, group=group)
            x = input_ids if c == 0 else h
            out = self.parts[k](x, media if c == 0 else None, cache=None if cache is None else cache[k], **kw)
            if c == self.num_chunks - 1:
                # contiguous: the broadcast sends the tensor's memory, and a slice of a batch's positions is a view
                # with gaps (the other ranks received row 0 right and the rest from the wrong offsets)
                logits = _whole(out[:, keep]).contiguous()
            else:
                nxt = dist.get_global_rank(group, (c + 1) % pp)
                out = out.to_local() if isinstance(out, DTensor) else out
                dist.send(torch.tensor([_DTYPES.index(out.dtype)], device=device), dst=nxt, group=group)
                dist.send(out.contiguous(), dst=nxt, group=group)
        dist.broadcast(logits, src=dist.get_global_rank(group, last_holder), group=group)
        return logits

    def finish(self) -> None:
        """After generating: FSDP2 modules back to their sharded parameters (ZeRO-2 keeps them gathered after a
        forward; training's next forward then finds them as it left them)."""
        for part in self.parts:
            for m in part.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()


def _right_padded(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    segment_ids: torch.Tensor | None,
    extra: int,
    filler: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A forward's inputs with ``extra`` filler positions after the real ones: the filler's positions continue each
    row's last, its segment is the row's last (a real segment: no query without a key), never attended by a real
    position (causal)."""
    b = input_ids.shape[0]
    ids = torch.cat([input_ids, input_ids.new_full((b, extra), filler)], 1)
    if position_ids is not None:  # [B, S] or [P, B, S]
        step = torch.arange(1, extra + 1, device=position_ids.device, dtype=position_ids.dtype)
        position_ids = torch.cat([position_ids, position_ids[..., -1:] + step], -1)
    if segment_ids is not None:  # [B, K]: K covers the cached positions too
        segment_ids = torch.cat([segment_ids, segment_ids[:, -1:].expand(-1, extra)], 1)
    return ids, position_ids, segment_ids


def _whole(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` fp32 over the whole vocabulary (a vocabulary-sharded DTensor is gathered)."""
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return logits.float()
