"""Model FLOPs of a NeVA training step, and the peak FLOP/s they are measured against (MFU = one over the other).

The one count behind ``metrics.csv`` (``flops``, ``tflops_per_sec_per_device``, ``mfu``), the planner's per-stage
FLOPs and the benchmark's MFU. Rules, per matmul:

* A weight of ``n`` elements costs ``2n`` per row it multiplies in the forward (an LLM position, an image token, a ViT
  token, a patch), ``2n`` more for its input gradient when a trained parameter sits upstream of its input (autograd
  computes no gradient for an input that needs none), and ``2n`` more for its own gradient when it trains. So a
  trained decoder weight costs 6n, a frozen decoder weight under a trained projector 4n (pretraining), the first
  projector Linear over a frozen tower 4n, a frozen tower first in line 2n (forward only).
* The attention core (scores and weighted values) costs ``4·S·d`` per row in the forward (``S`` = the sample's own
  length, ``d`` = heads × head dim; the causal half is not discounted, as in Megatron's count), ×3 when a trained
  parameter sits upstream of it (its backward is input gradients only: two forwards). Under a sliding window ``W``
  the square ``S²`` becomes the same count over the pairs a query sees: ``W² + 2W(S - W)`` once ``S > W``
  (``attended_square``).
* Only vision layers up to the deepest selected hidden state run; the patch convolution multiplies ``num_patches``
  rows. Embedding lookups, norms, biases and elementwise ops are not counted. The LM head counts at every position
  (Megatron's convention), although the one-process engine runs it on learned positions only.
* A native-resolution tower (Qwen-VL) counts per patch, not per image (``image`` then means a patch, and
  ``Media.tower_inputs`` counts patches: its pixels' rows): each block weight 2n per patch, the merger per merged
  token (1 / merge² of a patch), the attention core ``4·L·d`` per patch with ``L`` the patches a patch attends: its
  window's under window attention, the nominal ``image_size``'s in a full block (an estimate: the real image's count
  varies). Given an image's patch grid (``flop_terms(grid=...)``, the planner's image at its pixel budget) the count is
  that image's exactly: ``L`` averaged over its patches, ``Σ n_w² / P`` over its windows (Qwen2.5-VL's, cut from
  the top-left in merged units, the last ones partial) or ``P`` in a full block.
* MoE: the router is a ``[E, H]`` weight like any other; the stacked experts count the k of E each token runs
  (active FLOPs, Megatron's MoE count): ``k / E`` of the stacked tensors per token.
* Padding is not counted (FLOPs spent on padding are waste), nor activation-checkpoint recomputation (the planner
  adds it to the FLOPs a GPU executes, not to model FLOPs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from neva.families import merger_spec
from neva.models.config import NevaConfig
from neva.models.decoder_traits import chunk, sliding
from neva.models.delta_rule import CHUNK

Param = tuple[str, tuple[int, ...], bool]  # name, shape, requires_grad

# Order inside a block along the data flow; siblings (wq, wk, wv read the same input) share a step, and a LoRA
# ``lora_b`` sits half a step after the ``lora_a`` it reads from.
_VISION_STEPS = {
    "norm1": 0, "q_proj": 1, "k_proj": 1, "v_proj": 1, "qkv": 1, "core": 2, "o_proj": 3, "norm2": 4, "fc1": 5,
    "gate_proj": 5, "up_proj": 5, "fc2": 6, "down_proj": 6,
    # InternViT: q / k norms between the projections and the core, layer scales after each branch
    "q_norm": 1.25, "k_norm": 1.25, "lambda_1": 3.5, "lambda_2": 6.5,
}  # fmt: skip
_MERGER_STEPS = {"norm": 0, "fc1": 1, "fc2": 2}  # a native tower's patch merger (and its DeepStack mergers)
_DECODER_STEPS = {
    "attention_norm": 0, "wq": 1, "wk": 1, "wv": 1, "core": 2, "wo": 3, "ffn_norm": 4, "w1": 5, "w3": 5, "w2": 6,
    "router": 4.5, "q_norm": 1.25, "k_norm": 1.25,  # Qwen3: per-head norms between the projections and the core
    "post_attention_norm": 3.5, "post_ffn_norm": 6.5,  # Gemma: the outputs' norms before the residual adds
    # Qwen3.5's linear attention (the projections, the convolution and gates, the core, its gated norm, out_proj) and
    # the MoE's shared-expert gate (its SwiGLU is w1 / w3 / w2)
    "in_proj_q": 1, "in_proj_k": 1, "in_proj_v": 1, "in_proj_z": 1, "in_proj_b": 1, "in_proj_a": 1, "conv_q": 1.5,
    "conv_k": 1.5, "conv_v": 1.5, "A_log": 1.5,
    "dt_bias": 1.5, "norm": 2.5, "out_proj": 3, "gate": 4.5,
}  # fmt: skip
# Projectors of named layers: Gemma 3's (after its parameter-free pool), Mistral 3's (norm, merge, Linear-GELU-Linear)
_NAMED_PROJECTOR_STEPS = {"norm": 0, "proj": 1, "merging_layer": 1, "linear_1": 2, "linear_2": 3}


@dataclass(frozen=True)
class FlopTerm:
    """One matmul of a training step: a weight's, or an attention core's.

    Attributes:
        name: the weight's parameter name, or ``<block>.core`` for an attention core
            (``llm.layers.3.attention.core``, ``vision.layers.0.attn.core``).
        per: the unit its FLOPs are counted per: ``token`` (LLM position), ``token2`` (square of the sample's
            length: the decoder's attention core; the band of a sliding window), ``token2_full`` (the whole square:
            a global layer of a decoder whose other layers slide, Gemma 3's ``layer_types``), ``token2_chunked``
            (the squares of the sample's attention chunks: Llama 4's ``chunked_attention`` layers), ``image`` or
            ``frame`` (a video frame: a tower pass, the projector over its pooled tokens).
        forward: forward FLOPs per unit.
        backward: backward FLOPs per unit (input and weight gradients).
        layer: the decoder layer the term belongs to, else None.
    """

    name: str
    per: str
    forward: float
    backward: float
    layer: int | None = None

    @property
    def total(self) -> float:
        return self.forward + self.backward


def model_params(model: nn.Module) -> list[Param]:
    """``(name, shape, requires_grad)`` of every parameter of ``model`` (tied weights once; meta tensors are fine)."""
    return [(name, tuple(p.shape), p.requires_grad) for name, p in model.named_parameters()]


def _step(pieces: list[str], steps: dict[str, int]) -> float:
    step = next(steps[p] for p in pieces if p in steps)
    return step + 0.5 if "lora_b" in pieces else step


def _position(name: str, cfg: NevaConfig) -> tuple[float, float, float] | None:
    """Where ``name`` sits along the data flow (vision → projector → decoder), or None when it never runs."""
    pieces = name.split(".")
    if pieces[0] == "vision":
        if pieces[1] == "layers":
            layer = int(pieces[2])
            return None if layer >= cfg.vision.layers_run else (0, 2 + layer, _step(pieces[3:], _VISION_STEPS))
        if pieces[1] == "post_norm":  # LLaVA's features skip it (CLIP and SigLIP alike); Gemma 3's read it
            return (0, 2 + cfg.vision.layers_run, 0) if cfg.vision.feature_norm else None
        return (0, 0 if pieces[1] == "patch_embed" else 1, 0)
    if pieces[0] == "projector":
        own = merger_spec(cfg.projector.type)
        if own is not None and own.merger.flop_steps:
            return (1, dict(own.merger.flop_steps)[pieces[1]], 0)
        if pieces[1] in ("merger", "deepstack"):
            return (1, _MERGER_STEPS[pieces[-2]], 0)
        if pieces[1] in _NAMED_PROJECTOR_STEPS:
            return (1, _NAMED_PROJECTOR_STEPS[pieces[1]], 0)
        return (1, int(pieces[1]), 0)
    if pieces[1] == "tok_embeddings":
        return (2, -1, 0)
    if pieces[1] == "layers":
        return (2, int(pieces[2]), _step(pieces[3:], _DECODER_STEPS))
    return (2, cfg.llm.num_layers, 0 if pieces[1] == "norm" else 1)  # final norm, then the LM head


def _rows(name: str, shape: tuple[int, ...], cfg: NevaConfig) -> tuple[str, int] | None:
    """``(per, rows)``: the rows a weight multiplies per unit, or None for a parameter that is no matmul weight."""
    native = cfg.vision is not None and cfg.vision.spec.patch_grid  # counted per patch, not per image
    if name == "vision.patch_embed.weight":
        return "image", 1 if native else cfg.vision.num_patches
    if name == "projector.downsample.weight":  # GLM-4.1V's Conv2d [out, C, merge, merge]: once per merged token
        return "image", 1 / cfg.vision.spatial_merge_size**2
    if ".experts." in name:  # MoE experts [E, ., .]: a token runs k of the E (active FLOPs)
        return "token", cfg.llm.moe_router_topk / cfg.llm.num_moe_experts
    if len(shape) != 2:
        return None  # norms, biases, the CLS token
    if name.startswith("vision.layers."):
        return "image", 1 if native else cfg.vision.seq_len
    if name.startswith("projector."):
        return "image", 1 / cfg.vision.spatial_merge_size**2 if native else cfg.num_image_tokens
    if name.startswith(("llm.layers.", "llm.output.")):
        return "token", 1
    return None  # tables that are looked up or added: token and ViT position embeddings


def flop_terms(params: Iterable[Param], cfg: NevaConfig, grid: tuple[int, int] | None = None) -> list[FlopTerm]:
    """Every counted matmul of one training step of the whole model, per unit of work (see the module docstring).

    Args:
        params: the unsharded model's parameters with ``requires_grad`` set by the run's trainable policy
            (``model_params(build_meta_model(cfg, policy))``).
        cfg: the model's config.
        grid: a native tower's image (height, width) in patches: its own attention count per patch (None: the
            nominal ``image_size``'s).
    """
    params = [(name, shape, trains, _position(name, cfg)) for name, shape, trains in params]
    trained = [pos for _, _, trains, pos in params if trains and pos is not None]
    first_trained = min(trained) if trained else None

    def upstream_trains(pos: tuple[float, float, float]) -> bool:
        return first_trained is not None and first_trained < pos

    terms = []
    for name, shape, trains, pos in params:
        if name == "llm.tok_embeddings.weight" and cfg.llm.tie_word_embeddings:
            name = "llm.output.weight"  # the tied LM head multiplies by the embedding table
            pos = _position(name, cfg)
        rows = _rows(name, shape, cfg)
        if pos is None or rows is None:
            continue
        per, count = rows
        forward = 2 * math.prod(shape) * count
        backward = forward * (upstream_trains(pos) + trains)
        layer = int(name.split(".")[2]) if name.startswith("llm.layers.") else None
        terms.append(FlopTerm(name, per, forward, backward, layer))
    terms += _attention_cores(cfg, upstream_trains, grid)
    return terms + _frame_terms(terms, cfg)


def _frame_terms(terms: list[FlopTerm], cfg: NevaConfig) -> list[FlopTerm]:
    """A video frame's terms: an image's tower pass, the projector over the frame's (pooled) tokens."""
    if cfg.video is None:
        return []
    scale = cfg.video.frame_tokens(cfg.vision.grid, cfg.num_image_tokens) / cfg.num_image_tokens
    out = []
    for t in terms:
        if t.per == "image":
            k = scale if t.name.startswith("projector.") else 1.0
            out.append(FlopTerm(t.name, "frame", t.forward * k, t.backward * k))
    return out


def _attention_cores(
    cfg: NevaConfig, upstream_trains: Callable[[tuple], bool], grid: tuple[int, int] | None = None
) -> list[FlopTerm]:
    terms = []
    if cfg.vision is not None:
        v = cfg.vision
        for i in range(cfg.vision.layers_run):
            forward = 4 * _tower_square(v, i, grid) * v.hidden_size
            backward = 2 * forward if upstream_trains((0, 2 + i, _VISION_STEPS["core"])) else 0
            terms.append(FlopTerm(f"vision.layers.{i}.attn.core", "image", forward, backward))
    width = cfg.llm.num_heads * cfg.llm.head_dim
    for i in range(cfg.llm.num_layers):
        linear = cfg.llm.is_linear_layer(i)
        forward = linear_core_flops(cfg.llm.linear_attention) if linear else 4 * width
        backward = 2 * forward if upstream_trains((2, i, _DECODER_STEPS["core"])) else 0
        # A linear-attention layer's core grows with the tokens (``linear_core_flops``); a global layer between
        # sliding ones (Gemma 3's layer_types) attends the whole square; a layer within the window the band
        # (``attended_square``).
        if linear:
            per = "token"
        elif chunk(cfg.llm, i):
            per = "token2_chunked"
        elif cfg.llm.layer_types is not None and not sliding(cfg.llm, i):
            per = "token2_full"
        else:
            per = "token2"
        terms.append(FlopTerm(f"llm.layers.{i}.attention.core", per, forward, backward, i))
    return terms


def linear_core_flops(la, chunk: int = CHUNK) -> float:
    """Forward FLOPs per token of a Gated DeltaNet core (``neva.models.delta_rule``, chunks of ``chunk``), per value
    head: the chunk's key-key and query-key products (``2·C·dk`` each), the triangular solve for both right-hand
    sides (``C·(dk + dv)``), the scores times the corrections (``2·C·dv``) and three state products (``6·dk·dv``:
    the corrections' and the queries' reads, the update). Linear in the sample's length: no ``S²`` term."""
    dk, dv = la.key_head_dim, la.value_head_dim
    return la.num_value_heads * (4 * chunk * dk + chunk * (dk + dv) + 2 * chunk * dv + 6 * dk * dv)


def _tower_square(vision, layer: int, grid: tuple[int, int] | None = None) -> float:
    """Rows × keys of a tower block's attention core per unit: a fixed-size tower's whole image; a native tower's per
    patch (its window's patches, or the nominal image's in a full block; of the image of ``grid`` patches when
    given)."""
    if not vision.spec.patch_grid:
        return vision.seq_len**2
    windowed = vision.spec.window_attention and layer not in vision.fullatt_block_indexes
    if grid is not None:
        return window_square(vision, grid) if windowed else grid[0] * grid[1]
    if windowed:
        return (vision.window_size // vision.patch_size) ** 2
    return (vision.image_size // vision.patch_size) ** 2


def window_square(vision, grid: tuple[int, int]) -> float:
    """Keys a patch attends, averaged over an image of ``grid`` (height, width) patches, under Qwen2.5-VL's window
    attention: windows of ``window_size`` pixels cut from the top-left in merged tokens (the last row and column of
    windows partial), a window of ``n`` patches attending ``n`` keys from each of its ``n`` rows."""
    merge = vision.spatial_merge_size
    side = vision.window_size // merge // vision.patch_size  # merged tokens per window side

    def spans(length: int) -> list[int]:
        return [side] * (length // side) + ([length % side] if length % side else [])

    h, w = grid[0] // merge, grid[1] // merge
    total = sum((a * b * merge**2) ** 2 for a in spans(h) for b in spans(w))
    return total / (grid[0] * grid[1])


def attended_square(seq_len: int, window: int | None) -> int:
    """The ``S²`` of the attention core's count for a sample of ``seq_len`` positions: ``S²`` (the full square, as
    Megatron counts causal attention), or under a sliding ``window`` the same convention over the band of keys each
    query sees (``W²`` for the first ``W`` queries' triangle counted as a square, ``2W`` per later query)."""
    if window is None or seq_len <= window:
        return seq_len * seq_len
    return window * window + 2 * window * (seq_len - window)


def chunked_square(seq_len: int, chunk_size: int) -> int:
    """The ``S²`` of a chunked attention core's count (Llama 4): each chunk of the sample counted as a square of its
    length, by the convention of ``attended_square``."""
    full, rest = divmod(seq_len, chunk_size)
    return full * chunk_size * chunk_size + rest * rest


@dataclass(frozen=True)
class SampleFlops:
    """Training FLOPs of a sample of ``S`` LLM positions (image and video positions included), ``images`` images and
    ``frames`` video frames: ``per_token · S + per_token2 · S² + per_image · images + per_frame · frames``. Cheap to
    evaluate for every step's samples."""

    per_token: float
    per_token2: float
    per_image: float
    window: int | None = None  # the decoder's sliding window (``attended_square``)
    per_frame: float = 0.0
    per_token2_full: float = 0.0  # global layers among sliding ones: the whole square, whatever the window
    per_token2_chunked: float = 0.0  # chunked layers: the squares of the sample's chunks of ``chunk`` tokens
    chunk: int | None = None

    @classmethod
    def from_terms(cls, terms: Iterable[FlopTerm], window: int | None = None, chunk: int | None = None) -> SampleFlops:
        totals = {"token": 0.0, "token2": 0.0, "image": 0.0, "frame": 0.0, "token2_full": 0.0, "token2_chunked": 0.0}
        for term in terms:
            totals[term.per] += term.total
        return cls(
            totals["token"],
            totals["token2"],
            totals["image"],
            window,
            totals["frame"],
            totals["token2_full"],
            totals["token2_chunked"],
            chunk,
        )

    @classmethod
    def of(cls, model: nn.Module) -> SampleFlops:
        """The counts of ``model`` (whole, unsharded, its trainable policy applied; ``build_meta_model`` gives one)."""
        llm = model.cfg.llm
        return cls.from_terms(flop_terms(model_params(model), model.cfg), llm.sliding_window, llm.attention_chunk_size)

    def sample(self, seq_len: int, images: int) -> float:
        return self.batch([seq_len], images)

    def batch(self, seq_lens: Iterable[int], images: int, frames: int = 0) -> float:
        """FLOPs of samples of lengths ``seq_lens`` (padding excluded) holding ``images`` images and ``frames``
        video frames in all."""
        lens = list(seq_lens)
        square = sum(attended_square(s, self.window) for s in lens)
        per_media = self.per_image * images + self.per_frame * frames
        full = self.per_token2_full * sum(s * s for s in lens)
        if self.per_token2_chunked:
            full += self.per_token2_chunked * sum(chunked_square(s, self.chunk) for s in lens)
        return self.per_token * sum(lens) + self.per_token2 * square + full + per_media


# Dense bf16 tensor-core peaks (datasheets), TFLOP/s, found by substring in a device name
# (``torch.cuda.get_device_name()`` or ``cluster.gpu_name``).
PEAK_TFLOPS_BF16 = {
    "H100": 989.0,
    "H200": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
}


def device_peak_tflops(name: str | None, configured: float | None = None) -> float | None:
    """The bf16 peak MFU divides by: ``configured`` (``cluster.peak_tflops_bf16``, ``--peak-tflops``) when set,
    else the datasheet value of the device ``name``, else None (unknown device, or CPU)."""
    if configured:
        return configured
    if not name:
        return None
    return next((value for key, value in PEAK_TFLOPS_BF16.items() if key in name), None)
