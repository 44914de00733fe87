"""Activation memory per micro-batch: the tensors autograd saves for backward, op by op (an estimate).

Counted for the decoder (bf16 unless the compute dtype says otherwise, flash/efficient SDPA so no ``s²`` scores):
RMSNorm saves its fp32 input, SDPA saves q, k, v, out and the log-sum-exp, SwiGLU saves ``w1 x``, ``silu(w1 x)`` and
``w3 x`` (an MoE layer those of its ``k`` experts per token, and its dispatched rows: ``_ffn_elements``). A trained
Linear also saves its input (for the weight gradient); a frozen one does not, which is why pretraining (frozen
decoder) needs far less. Tensors between TP regions are full-size on every TP rank unless
sequence parallelism shards them. The vision tower saves nothing when frozen (``no_grad``).
"""

from __future__ import annotations

from neva.models.config import NevaConfig
from neva.models.decoder_traits import traits
from neva.parallel.layout import Layout
from neva.parallel.pipeline import local_chunks
from neva.parallel.step_decisions import StepDecisions
from neva.planner.deployment import Deployment
from neva.planner.flops import checkpointed_layers
from neva.planner.linear_attention import linear_layer_bytes
from neva.planner.params import ParamInfo


def _layer_bytes(
    cfg: NevaConfig, dep: Deployment, tokens: float, trains: bool, mode: str | None, layer: int = 0
) -> float:
    """Bytes decoder layer ``layer`` keeps for ``tokens`` tokens of a micro-batch on this rank (``1/cp`` of each row
    under context parallelism, whose attention keeps the whole rows' gathered keys and values: ``cp`` times its own;
    a linear-attention layer its own terms, ``neva.planner.linear_attention``)."""
    llm, e, t, cp = cfg.llm, dep.compute_bytes, dep.layout.tp, dep.layout.cp
    rep = t if dep.layout.sp else 1
    h = tokens * llm.hidden_size
    q = tokens * llm.num_heads * llm.head_dim / t
    kv = tokens * llm.num_kv_heads * llm.head_dim / t
    f, dispatched = _ffn_elements(cfg, tokens, t, layer)
    sdpa = e * (2 * q + 2 * kv * cp) + 4 * tokens * llm.num_heads / t
    if llm.is_linear_layer(layer):
        sdpa, q = linear_layer_bytes(llm, tokens, e, t, cp), tokens * llm.linear_attention.value_dim / t
    if mode == "full":
        return e * h / rep  # only the layer input survives; the recomputed layer is counted once per stage
    linear_inputs = (2 * e * h + e * q + e * f + e * dispatched) if trains else 0.0
    if mode == "selective":
        # Elementwise ops (norms, SiLU·mul) are recomputed from the kept matmul inputs/outputs and SDPA tensors.
        return e * h / rep + sdpa + linear_inputs + 2 * e * f + 2 * e * dispatched
    # RMSNorms keep their fp32 inputs: two per block, four with Gemma's post-attention / post-feed-forward norms.
    norms = (4 if traits(llm).sandwich_norms else 2) * 4 * h / rep + (2 * e * h / rep if trains else 0.0)
    return norms + sdpa + 3 * e * f + 2 * e * dispatched + linear_inputs


def _ffn_elements(cfg: NevaConfig, tokens: int, tp: int, layer: int = 0) -> tuple[float, float]:
    """``(f, d)``: elements of one feed-forward intermediate tensor and of one dispatched hidden-state tensor on a
    rank, for ``tokens`` tokens.

    Dense: ``tokens × intermediate / tp`` (column-parallel), nothing dispatched. MoE (``neva.models.moe``): every
    token runs ``k`` experts, whose router and experts are replicated over tp (every TP rank runs the whole
    sequence), so ``f = k × tokens × intermediate``; under expert parallelism a rank receives as many rows as it sends
    (uniform routing, ``expert_parallel.UniformDispatch``). ``d = k × tokens × hidden``: the experts' outputs, saved
    by the routing-weight multiply, and the weighted rows, saved by the ``index_add_`` that combines them (a trained
    layer also keeps its rows grouped by expert, the input of ``w1`` and ``w3``: one more ``d``). Measured by the
    rehearsal: NeMo's Mixtral 8x7B pretrain keeps 78.8 MiB per layer at 320 tokens, the planned 42.5 dense + 36.25.
    An interleaved MoE decoder's dense layers (Llama 4's ``moe_layer_freq``) count as dense, at their own width; a
    shared expert (Qwen3.5-MoE, Llama 4) adds its SwiGLU on every token (not sharded: the MoE layer's parts are
    replicated over tp).
    """
    llm = cfg.llm
    if not llm.is_moe_layer(layer):
        return tokens * llm.dense_width / tp, 0.0
    k = llm.moe_router_topk
    shared = tokens * (llm.moe_shared_expert_intermediate_size or 0)
    return k * tokens * llm.intermediate_size + shared, k * tokens * llm.hidden_size


def stage_activation_bytes(*args, **kwargs) -> float:
    """Peak activation bytes on one GPU of a stage: ``stage_activation_split``'s device bytes and host bytes together
    (what the stage saves, wherever it waits)."""
    device, host = stage_activation_split(*args, **kwargs)
    return device + host


def stage_activation_split(
    cfg: NevaConfig,
    infos: list[ParamInfo],
    dep: Deployment,
    seq_len: int,
    stage: int,
    layers: list[int],
    backward: bool,
    in_flight: float,
    learned_tokens: float | None = None,
    tiles: int = 1,
    frames: int = 0,
) -> tuple[float, float]:
    """(device, host) activation bytes at the peak of one GPU of pipeline stage ``stage`` with ``in_flight``
    micro-batches alive: all on the device, unless ``model.activation_offload`` keeps what the decoder blocks save in
    host memory (the device then keeps one block's worth: the block being run; ``neva.planner.offload``).

    ``learned_tokens``: learned tokens per sample; where the engine runs the LM head only at their positions
    (``StepDecisions.learned_only_head``: without TP and PP). None: every position (the count before the rehearsal
    measured it).
    ``tiles``: tower inputs per image (AnyRes, ``neva.planner.images``; a native tower's patches per image);
    ``frames`` > 0: each sample holds one video of that many frames instead of one image. Under context parallelism
    a rank encodes its share of the micro-batch's tower inputs (``StepDecisions.tower_inputs``): images, tiles or
    frames by count, a native tower's images whole."""
    if not backward:
        return 0.0, 0.0
    layout = dep.layout
    decisions = StepDecisions.of(layout)
    e, b = dep.compute_bytes, layout.micro_batch_size
    seq_len = seq_len / layout.cp  # context parallelism: this rank's share of each row
    tokens = b * seq_len
    trains = {i: any(p.trainable for p in infos if p.layer == i) for i in layers}
    recomputed = checkpointed_layers(layout, cfg.llm.num_layers)
    saved = [_layer_bytes(cfg, dep, tokens, trains[i], layout.ac if i in recomputed else None, i) for i in layers]
    per_mb = 0.0
    last = stage == layout.pp - 1
    if last:
        # Logits (vocab-sharded under TP without PP): bf16 output plus the fp32 copy the cross-entropy keeps for its
        # backward; at learned positions only where the engine runs the head there.
        learned_only = decisions.learned_only_head and learned_tokens is not None
        head = b * learned_tokens / layout.cp if learned_only else tokens
        vocab = cfg.llm.vocab_size / layout.tp if decisions.vocab_parallel else cfg.llm.vocab_size
        per_mb += head * vocab * (e + 4)
    # The busiest cp rank's share of the micro-batch's tower inputs (1.0 without context parallelism): a native
    # tower's whole images (of ``tiles`` patches each), else every image's tiles, or every frame, one input each.
    if stage == 0 and cfg.vision is not None and cfg.vision.spec.patch_grid:
        share = decisions.tower_inputs(b) / b
        per_mb += _native_vision_bytes(cfg, infos, dep) * tiles * share
    elif stage == 0 and cfg.vision is not None:
        inputs = b * (frames or tiles)
        share = decisions.tower_inputs(inputs) / inputs
        per_mb += _vision_bytes(cfg, infos, dep, frames) * (1 if frames else tiles) * share
    if stage == 0:  # the first stage's layer input (a later stage's is one of its receive buffers)
        per_mb += e * tokens * cfg.llm.hidden_size
    recompute = 0.0
    if layout.ac == "full" and layers:
        # During backward, one checkpointed layer is rebuilt with all its activations.
        recompute = max(_layer_bytes(cfg, dep, tokens, any(trains.values()), None, i) for i in layers)
    device = in_flight * per_mb + recompute + pipeline_buffer_bytes(cfg, dep, seq_len, stage)
    if layout.activation_offload and saved:
        return device + max(saved), in_flight * sum(saved) - max(saved)
    return device + in_flight * sum(saved), 0.0


def pipeline_buffer_bytes(cfg: NevaConfig, dep: Deployment, seq_len: int, stage: int) -> float:
    """torch's ``PipelineStage`` allocates a receive buffer per micro-batch of the step, kept from step to step: for
    the activations of every chunk but the first and for their gradients of every chunk but the last, each
    ``[micro_batch_size, seq_len, hidden]`` in the residual stream's dtype (the parameters': bf16 under O2, fp32
    under autocast). Measured by the rehearsal."""
    layout = dep.layout
    if layout.pp == 1:
        return 0.0
    last = layout.num_chunks - 1
    buffers = sum((c > 0) + (c < last) for c in local_chunks(stage, layout.pp, layout.vpp))
    stream = 2 if dep.precision in ("o2", "half") else 4
    return buffers * layout.grad_accum * layout.micro_batch_size * seq_len * cfg.llm.hidden_size * stream


def _vision_bytes(cfg: NevaConfig, infos: list[ParamInfo], dep: Deployment, frames: int = 0) -> float:
    """Vision tower + projector activations of one micro-batch (one image, or one video of ``frames`` frames, per
    sample: a frame is a tower pass, the projector runs on its pooled tokens)."""
    e, b = dep.compute_bytes, dep.layout.micro_batch_size
    vision, hidden = cfg.vision, cfg.llm.hidden_size
    images_tokens = b * cfg.num_image_tokens
    if frames:
        images_tokens = b * cfg.video_tokens(frames)
        b *= frames
    total = 0.0
    if any(p.trainable for p in infos if p.part == "vision"):
        tokens = b * vision.seq_len
        # Per block: two LayerNorm inputs, q/k/v/out, o_proj and fc1 inputs, fc1 output and activation output.
        per_layer = e * tokens * (8 * vision.hidden_size + 2 * vision.intermediate_size)
        total += per_layer * vision.num_layers
    if any(p.trainable for p in infos if p.part == "projector"):
        total += e * images_tokens * (cfg.projector.input_size + 2 * hidden)
    return total


def _native_vision_bytes(cfg: NevaConfig, infos: list[ParamInfo], dep: Deployment) -> float:
    """A native-resolution tower + merger's activations per patch of a micro-batch (``tiles`` = an image's
    patches, ``neva.planner.images``). Attention runs in windows / per image through memory-efficient SDPA, so it keeps
    no scores: nothing grows with the window or the image, only with its patches. Per block: two norm inputs,
    q/k/v/out, o_proj and first MLP input, and the MLP's intermediates: SwiGLU (Qwen2.5-VL: gate and up outputs,
    SiLU output, their product; the family's ``gated_mlp``) 4, GELU (Qwen2-VL) 2; and the patch embedding's input, one flattened patch. The merger (``projector``): per merged token its input (merge²
    patches' width) and two hidden-wide tensors, as the MLP projector's count."""
    e, b = dep.compute_bytes, dep.layout.micro_batch_size
    vision = cfg.vision
    total = 0.0
    if any(p.trainable for p in infos if p.part == "vision"):
        mlp = 4 if vision.spec.gated_mlp else 2
        total += e * b * (8 * vision.hidden_size + mlp * vision.intermediate_size) * vision.layers_run
        total += e * b * vision.patch_dim  # the patch embedding's input (its weight trains)
    if any(p.trainable for p in infos if p.part == "projector"):
        merged = b / vision.spatial_merge_size**2
        total += e * merged * (cfg.projector.input_size + 2 * cfg.llm.hidden_size)
    return total


def in_flight_microbatches(layout: Layout, stage: int) -> float:
    """Micro-batches whose activations a stage holds at its peak (1F1B warm-up depth; GPipe holds all)."""
    m, pp, v = layout.grad_accum, layout.pp, layout.vpp
    if pp == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if v > 1:
        # Megatron's interleaved warm-up: 2·(pp − stage − 1) + (v − 1)·pp chunk-micro-batches, each 1/v of a stage.
        return min(float(m), (2 * (pp - stage - 1) + (v - 1) * pp + 1) / v)
    return float(min(m, pp - stage))
