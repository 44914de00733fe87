"""Llama decoder, pipeline-splittable.

Layers live in an ``nn.ModuleDict`` keyed by the global layer index, and ``tok_embeddings``, ``norm`` and ``output``
may be ``None``: a pipeline stage deletes what it does not own and the same ``forward`` runs on it. The loss is not
computed here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

import torch
from torch import nn

from neva.models.attention import AttentionPlan, plan_attention
from neva.models.config import LLMConfig
from neva.models.context_shard import ContextShard
from neva.models.decoder_traits import chunk, embed_scale, norm_offset, sliding, temperature_tuned, traits
from neva.models.gated_deltanet import GatedDeltaNet, RecurrentCache, new_recurrent_cache
from neva.models.layers import RMSNorm, gelu_tanh_gated, swiglu
from neva.models.moe import MoEFeedForward
from neva.models.packed_rows import PackedRows
from neva.models.recurrent_shard import RecurrentShard
from neva.models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from neva.models.token_inputs import TokenInputs, at_rows, token_inputs, token_inputs_at


@dataclass
class KVCache:
    """Pre-allocated keys/values of one layer, ``[B, kv_heads, max_len, head_dim]``; ``length`` tokens are filled."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


def new_layer_caches(
    cfg: LLMConfig, layers: list[str], batch_size: int, max_len: int, kv_heads: int, device, dtype
) -> list[KVCache | RecurrentCache]:
    """Empty decoding caches of the named decoder layers: keys and values (``kv_heads`` of them) for attention,
    convolution inputs and the recurrent state for linear attention (``neva.models.gated_deltanet``)."""
    shape = (batch_size, kv_heads, max_len, cfg.head_dim)
    return [
        new_recurrent_cache(cfg, batch_size, device, dtype)
        if cfg.is_linear_layer(int(name))
        else KVCache(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
        for name in layers
    ]


class Attention(nn.Module):
    def __init__(self, cfg: LLMConfig, index: int = 0) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        # Qwen3.5: each head's query, then its output gate, side by side in wq's rows.
        self.gated = cfg.attention_output_gate
        q_rows = cfg.num_heads * cfg.head_dim * (2 if self.gated else 1)
        self.wq = nn.Linear(cfg.hidden_size, q_rows, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        # Qwen3, Qwen3.5, Gemma 3: each head's q and k RMS-normalised over head_dim before RoPE (one weight shared by the heads).
        offset = norm_offset(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset) if cfg.qk_norm else None
        # Llama 4: its RoPE layers' q and k RMS-normalised without a weight (after RoPE, as HF; RoPE keeps each
        # head's norm, so the order changes nothing but rounding).
        self.l2_eps = cfg.rms_norm_eps if cfg.qk_l2_norm and cfg.uses_rope(index) else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionPlan,
        cache: KVCache | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the (kv) heads.
        q = self.wq(x).view(b, s, -1, self.head_dim * (2 if self.gated else 1))
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if cos is not None:  # None: a NoPE layer (Llama 4)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if self.l2_eps is not None:
            q, k = _l2_norm(q, self.l2_eps), _l2_norm(k, self.l2_eps)
        if cache is not None:
            k, v = cache.update(k, v)
        out = attn.attend(q, k, v).transpose(1, 2).reshape(b, s, -1)
        if self.gated:
            out = out * torch.sigmoid(gate.reshape(b, s, -1))
        with token_inputs_at(rows):
            return self.wo(at_rows(out, rows))


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over head_dim without a weight, in fp32 and cast back (HF ``Llama4TextWeightlessRMSNorm``)."""
    f = x.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` channels of each head (all of them unless ``rotary_percent < 1``)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)`` (HF gate_proj = w1, up_proj = w3, down_proj = w2); Gemma's gate is
    tanh-GELU (the family's ``mlp_act``)."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        width = cfg.dense_width  # an interleaved MoE decoder's dense layers have their own width (Llama 4)
        self.w1 = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.w2 = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)
        self.w3 = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.gated = swiglu if traits(cfg).mlp_act == "silu" else gelu_tanh_gated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.gated(self.w1(x), self.w3(x)))


class DecoderBlock(nn.Module):
    def __init__(self, cfg: LLMConfig, index: int = 0) -> None:
        super().__init__()
        offset = norm_offset(cfg)
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        # The token mixer is the layer's kind: attention, or a hybrid decoder's linear attention.
        self.attention = GatedDeltaNet(cfg) if cfg.is_linear_layer(index) else Attention(cfg, index)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        # The MLP kind is configuration: dense SwiGLU, or Mixtral's experts (``cfg.num_moe_experts``; Llama 4 only
        # in the layers ``moe_layer_freq`` names).
        self.feed_forward = MoEFeedForward(cfg) if cfg.is_moe_layer(index) else FeedForward(cfg)
        # Gemma: the attention's and the feed-forward's outputs are normalised before their residual adds.
        sandwich = traits(cfg).sandwich_norms
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset) if sandwich else None
        self.post_ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset) if sandwich else None

    def forward(
        self,
        x,
        cos,
        sin,
        attn: AttentionPlan,
        cache: KVCache | RecurrentCache | None = None,
        rows: torch.Tensor | None = None,
        add: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``rows`` ``[N, 2]`` (row, column): return only these positions, ``[N, D]``. Keys and values still come
        from every position; the output projection, residual and feed-forward run on the N rows only, and the
        layers inside see the forward's per-token inputs at those rows (``neva.models.token_inputs``). ``add``
        ``[B, S, D]``: added to the output (DeepStack, ``neva.models.deepstack``), in the stream's layout."""
        out = self.attention(self.attention_norm(x), cos, sin, attn, cache, rows=rows)
        if self.post_attention_norm is not None:
            out = self.post_attention_norm(out)
        x = at_rows(x, rows) + out
        with token_inputs_at(rows):
            out = self.feed_forward(self.ffn_norm(x))
            if self.post_ffn_norm is not None:
                out = self.post_ffn_norm(out)
            x = x + out
        return x if add is None else x + at_rows(add, rows)


class LlamaDecoder(nn.Module):
    """Token embedding → blocks → final norm → LM head; each part optional (pipeline stages)."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderBlock(cfg, i) for i in range(cfg.num_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm_offset(cfg))
        self.output: nn.Linear | None = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        # Gemma 3: the sliding-window layers' own RoPE base (no scaling), beside the global layers' ``inv_freq``.
        if cfg.rope_local_theta is not None:
            self.register_buffer("inv_freq_local", rope_inv_freq(_local_rope(cfg)), persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[B, S, D]``, scaled where the family scales them (Gemma: × √hidden, rounded to the
        embedding's dtype as HF does); image features spliced in after are not."""
        h = self.tok_embeddings(input_ids)
        scale = embed_scale(self.cfg)
        return h if scale is None else h * torch.tensor(scale).to(h.dtype)

    def forward(
        self,
        h: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        cache: list[KVCache | RecurrentCache] | None = None,
        output_positions: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        dropout_keys: torch.Tensor | None = None,
        layer_additions: dict[str, torch.Tensor] | None = None,
        context: ContextShard | None = None,
        bidirectional: torch.Tensor | None = None,
        shared_prefix: bool = False,
    ) -> torch.Tensor:
        """Run the blocks on hidden states ``h`` ``[B, S, D]`` (embedded already; see ``NevaModel.embed``).

        Args:
            h: input hidden states of this stage.
            position_ids: ``[P, B, S]`` RoPE positions, ``P`` axes (default ``0..S-1``, offset by the cache length);
                ``[B, S]`` is the one-axis case. M-RoPE (``cfg.mrope_section``): ``P = 3`` (t, h, w), or one axis
                for positions equal on all three (``neva.models.rope.rope_cos_sin``).
            segment_ids: ``[B, K]`` sample id per key position (0 = padding); attention stays within a segment.
                With a cache, K covers the cached tokens plus the new ones. None = plain causal attention.
            cache: one ``KVCache`` per layer of this stage, for incremental decoding.
            output_positions: ``[N, 2]`` (row, column); only these positions go through the final norm and LM head
                (training needs logits only where a label is learned), returned as ``[N, V]``. An index, not a
                boolean mask: the output size is known on the host, so selecting costs no sync.
            token_mask: ``[B, S]`` True where a token counts in MoE routers' load-balancing statistics (padding
                does not); None = every position. Ignored by dense blocks.
            dropout_keys: ``[B, S]`` LoRA dropout keys (``neva.models.lora.token_dropout_keys``); None = the RNG
                stream's dropout. Both reach the layers that read them as the forward's ``TokenInputs``.
            layer_additions: ``{layer name: [B, S, D]}`` added to the residual stream after that layer (Qwen3-VL's
                DeepStack features, ``neva.models.deepstack``); each layer named must be on this stage.
            context: context parallelism: ``h`` holds this rank's columns of longer rows (``neva.models.context_shard``;
                attention gathers keys and values); the per-token inputs are this rank's columns too.
            bidirectional: ``[M, 2]`` (row, column among the ``S`` new tokens) positions whose maximal runs attend
                both ways (Gemma 3's image tokens; ``neva.models.attention``); None: causal everywhere.
            shared_prefix: each row's first segment is a prompt its later segments (completions of it) attend too
                (``neva.models.attention``); ``position_ids`` then place each completion after the prompt. Not with
                linear-attention layers (their state would have to branch at the prompt's end) or chunked attention.

        Returns:
            Logits ``[B, S, V]`` (``[N, V]`` with ``output_positions``) if this stage owns ``output``, else hidden states.
        """
        b, s, _ = h.shape
        offset = 0 if cache is None else cache[0].length
        if position_ids is None:
            position_ids = torch.arange(offset, offset + s, device=h.device).expand(1, b, s)
        elif position_ids.dim() == 2:
            position_ids = position_ids[None]
        cfg = self.cfg
        if shared_prefix and cfg.linear_attention is not None:
            raise ValueError("shared-prompt rows in a decoder with linear-attention layers")
        scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar**-0.5
        # One plan (and one RoPE table) per kind of layer: segment boundaries / the BlockMask are found once per forward.
        plans, ropes = {}, {}
        kinds = {name: _layer_kind(cfg, int(name)) for name in self.layers}
        for kind in sorted(set(kinds.values()) or {_layer_kind(cfg, 0)}):
            local, chunked, rope, tuned = kind
            window = cfg.sliding_window if local else None
            plan = plan_attention(
                segment_ids,
                s,
                offset,
                h.device,
                window,
                context,
                scale,
                bidirectional=bidirectional,
                batch=b,
                chunk=chunked or None,
                shared_prefix=shared_prefix,
            )
            plans[kind] = replace(plan, query_scale=_temperature(cfg, position_ids)) if tuned else plan
            if not rope:
                ropes[kind] = (None, None)
                continue
            inv_freq = self.inv_freq_local if local and cfg.rope_local_theta is not None else self.inv_freq
            ropes[kind] = rope_cos_sin(inv_freq, position_ids, h.dtype, cfg.mrope_section, cfg.mrope_interleaved)
        if cfg.linear_attention is not None:
            kernel = cfg.linear_attention.conv_kernel_dim
            recurrent = None
            if context is not None:  # the state passed from chunk to chunk of each row
                recurrent = RecurrentShard.of(context, kernel, h.device)
            elif segment_ids is not None and offset == 0:  # each packed sample starts its layers' state afresh
                recurrent = PackedRows.of(segment_ids, kernel, h.device)
            plans = {local: replace(plan, recurrent=recurrent) for local, plan in plans.items()}
        if output_positions is not None:
            output_positions = output_positions.to(h.device)
        layers = list(self.layers.values())
        names = list(self.layers.keys())
        additions = layer_additions or {}
        if additions.keys() - set(names):
            raise ValueError(f"layer additions for layers {sorted(additions.keys() - set(names))} not on this stage")
        # Only the output positions' final states are read: the last layer computes just those (its keys and values
        # still cover every position), skipping most of its work at prompt, image and padding positions. Not an MoE
        # layer: its router's load-balancing statistics cover every token.
        last_rows = output_positions is not None and bool(layers) and not self.cfg.is_moe
        with token_inputs(TokenInputs(dropout_keys, token_mask)):
            for i, layer in enumerate(layers):
                rows = output_positions if last_rows and i == len(layers) - 1 else None
                kv = None if cache is None else cache[i]
                add = additions.get(names[i])
                # ``add`` only where there is one: a block's hooks (SP's input plans) see the same call as before.
                extra = {} if add is None else {"add": add}
                kind = kinds[names[i]]
                h = layer(h, *ropes[kind], plans[kind], kv, rows=rows, **extra)
        if output_positions is not None and not last_rows:
            h = h[output_positions[:, 0], output_positions[:, 1]]
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
            if cfg.final_logit_softcapping is not None:
                cap = cfg.final_logit_softcapping
                h = torch.tanh(h / cap) * cap
        return h

    def reset_rope(self) -> None:
        """Recompute the RoPE buffers (non-persistent: ``to_empty`` leaves them uninitialised)."""
        self.inv_freq = rope_inv_freq(self.cfg, device=self.inv_freq.device)
        if self.cfg.rope_local_theta is not None:
            self.inv_freq_local = rope_inv_freq(_local_rope(self.cfg), device=self.inv_freq.device)

    def init_weights(self) -> None:
        self.reset_rope()
        std = 0.02
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=std)
        for layer in self.layers.values():
            for module in layer.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=std)
                    if module.bias is not None:  # HF's init: zero biases
                        nn.init.zeros_(module.bias)
                elif isinstance(module, MoEFeedForward):
                    module.reset_parameters(std)
                elif isinstance(module, (RMSNorm, GatedDeltaNet)):  # the latter: its conv, decay and gated norm
                    module.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not self.cfg.tie_word_embeddings:
            nn.init.normal_(self.output.weight, std=self.cfg.hidden_size**-0.5)


def _layer_kind(cfg: LLMConfig, layer: int) -> tuple[bool, int, bool, bool]:
    """What sets a layer's attention apart: sliding, its chunk (0: none), RoPE, temperature tuning."""
    return sliding(cfg, layer), chunk(cfg, layer) or 0, cfg.uses_rope(layer), temperature_tuned(cfg, layer)


def _temperature(cfg: LLMConfig, position_ids: torch.Tensor) -> torch.Tensor:
    """Llama 4's query factor ``[B, 1, S, 1]`` (fp32) at each token's position in its sample: 1 + s·log1p(floor((p +
    1) / f)). HF reads the row's column instead, the same position except in left-padded rows (where both sit far
    below Llama 4's f = 8192 in practice) and packed ones (where the sample's own position is the one trained)."""
    p = position_ids[0].float()
    f = cfg.attn_temperature_floor_scale
    return (torch.log1p(torch.floor((p + 1.0) / f)) * cfg.attn_temperature_scale + 1.0)[:, None, :, None]


def _local_rope(cfg: LLMConfig) -> LLMConfig:
    """The sliding layers' RoPE: base ``rope_local_theta``, no scaling (HF Gemma 3's ``sliding_attention`` default)."""
    return dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)
