"""Typed model configs: vision encoder, LLM decoder, projector and the NeVA glue.

Every config round-trips through a plain dict (``to_dict`` / ``from_dict``); ``from_dict`` rejects unknown keys so a
typo in a checkpoint's ``config.json`` or a Hydra override fails loudly instead of silently using a default.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar

from neva.families import MERGERS, decoder_spec, merger_spec, tower_spec
from neva.families.gemma3 import check_gemma3_projector
from neva.families.spec import TowerSpec
from neva.models.anyres import AnyResConfig, image_token_count
from neva.models.decoder_traits import check_decoder_fields
from neva.models.hybrid_config import LinearAttentionConfig
from neva.models.video import VideoConfig, video_token_count
from neva.typed import build

T = TypeVar("T")


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Build config dataclass ``cls`` from ``data``; unknown keys and wrong types are an error."""
    return build(cls, data)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-dict (JSON-ready) form of a config dataclass."""
    return dataclasses.asdict(cfg)


@dataclass
class VisionConfig:
    """ViT vision encoder (HF ``CLIPVisionConfig`` / ``SiglipVisionConfig`` fields under LLaVA/NeMo names).

    ``kind`` picks the tower (``neva.models.towers``): ``clip`` (class token, pre-LN, quick-GELU) or ``siglip``
    (SigLIP / SigLIP2 at a fixed resolution: no class token, no pre-LN, tanh-GELU, biased patch embedding), or a
    native-resolution Qwen tower (its family's ``patch_grid``; HF ``Qwen2VLVisionConfig`` & co. under these names: ``depth`` →
    ``num_layers``, ``embed_dim`` / ``hidden_size`` → ``hidden_size``, Qwen2-VL's ``mlp_ratio`` → ``intermediate_size
    = hidden_size * mlp_ratio``; ``out_hidden_size`` is the merger's ``ProjectorConfig.output_size``):

    * ``qwen2_vl``: LayerNorm blocks, fused qkv, fc1/fc2 quick-GELU MLP, Conv3d patch embedding without bias;
    * ``qwen2_5_vl``: RMSNorm blocks, biased SwiGLU gate/up/down MLP, window attention except in
      ``fullatt_block_indexes``;
    * ``qwen3_vl``: LayerNorm blocks, fc1/fc2 tanh-GELU MLP, biased patch embedding, a learned square grid of
      ``num_position_embeddings`` positions resampled (bilinear) to each image, DeepStack features after the blocks
      in ``deepstack_visual_indexes``.

    A native kind has no fixed image size: ``image_size`` is unused, and the per-image counts (``grid``,
    ``num_patches``, ``seq_len``, ``num_image_tokens``) raise; an image's count comes from its size
    (``neva.data.qwen_images.image_token_count``) or its ``grid`` row (t·h·w patches, t·h·w / merge² tokens).
    """

    kind: str = "clip"
    image_size: int = 336
    patch_size: int = 14
    num_channels: int = 3
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_layers: int = 24
    num_heads: int = 16
    layer_norm_eps: float | None = None  # None: the kind's (1e-5; the Qwen towers' 1e-6)
    hidden_act: str = "quick_gelu"
    # Hidden-state index as in HF ``output_hidden_states`` (0 = embeddings, after CLIP's pre-LN; -1 = last layer); a list
    # concatenates several layers along the feature dimension (HF ``vision_feature_layer`` as a list).
    # None: the kind's (-2 for CLIP / SigLIP as LLaVA; -1, the only choice, for the native Qwen towers).
    vision_select_layer: int | list[int] | None = None
    # "patch": the patch tokens (CLIP drops its CLS: HF "default"; SigLIP has none to drop: HF "full");
    # "cls_patch": CLIP's CLS and patches (HF "full"), not for a tower without a class token.
    vision_select_feature: str = "patch"
    # The selected hidden state after the tower's post-LayerNorm (Gemma 3 reads SigLIP's ``last_hidden_state``);
    # False: before it, as LLaVA reads ``hidden_states``. Needs the last layer selected.
    feature_norm: bool = False
    # The fit's PIL resampling (the HF image processor's ``resample``): bicubic (CLIP's, SigLIP's) or bilinear
    # (Gemma 3's).
    image_resample: str = "bicubic"
    image_mean: tuple[float, float, float] | None = None  # None: the tower kind's (CLIP's, or SigLIP's 0.5)
    image_std: tuple[float, float, float] | None = None
    # Native-resolution towers only (``spec.patch_grid``; HF Qwen vision config names). A patch is ``temporal_patch_size``
    # frames × ``patch_size``²; the merger folds ``spatial_merge_size``² neighbouring patches into one LLM token.
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112  # qwen2_5_vl: window side in pixels (window_size // merge // patch merge units)
    fullatt_block_indexes: list[int] = field(default_factory=list)  # qwen2_5_vl: blocks attending the whole frame
    num_position_embeddings: int = 2304  # qwen3_vl: the learned position grid (a square number)
    deepstack_visual_indexes: list[int] = field(default_factory=list)  # qwen3_vl: blocks whose outputs DeepStack reads
    # qwen2_5_vl: M-RoPE temporal positions per second of video (HF ``vision_config.tokens_per_second``); None: the
    # HF class default (4) where a video needs it.
    tokens_per_second: int | None = None
    # Block options of a family whose spec says ``block_options`` (InternViT; every other tower refuses other values):
    # the blocks' norm (``layer`` / ``rms``: HF ``norm_type``), an RMSNorm of q and of k over the whole width before the
    # heads split (HF ``use_qk_norm``), biased q / k / v (HF ``attention_bias``).
    norm_type: str = "layer"
    qk_norm: bool = False
    qkv_bias: bool = True

    def __post_init__(self) -> None:
        spec = tower_spec(self.kind)
        self.image_mean = spec.mean if self.image_mean is None else tuple(self.image_mean)
        self.image_std = spec.std if self.image_std is None else tuple(self.image_std)
        self.layer_norm_eps = spec.eps if self.layer_norm_eps is None else self.layer_norm_eps
        self.vision_select_layer = spec.select if self.vision_select_layer is None else self.vision_select_layer
        # The patch convolution (no padding) drops a remainder, as HF's does: SigLIP so400m/14 at 384 px sees 27×27
        # patches (378 px); the image is still resized to image_size.
        if self.image_size < self.patch_size:
            raise ValueError(f"image_size {self.image_size} is smaller than patch_size {self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.hidden_act not in spec.acts:
            raise ValueError(f"{self.kind} vision hidden_act must be {' or '.join(spec.acts)}, got {self.hidden_act!r}")
        if self.vision_select_feature not in ("patch", "cls_patch"):
            raise ValueError(f"vision_select_feature must be patch or cls_patch, got {self.vision_select_feature!r}")
        if self.vision_select_feature == "cls_patch" and not self.class_tokens:
            raise ValueError(f"vision_select_feature=cls_patch: a {self.kind} tower has no class token to keep")
        for layer in self.select_layers:
            if not -(self.num_layers + 1) <= layer <= self.num_layers:
                raise ValueError(f"vision_select_layer {layer} out of range for {self.num_layers} layers")
        if self.image_resample not in ("bicubic", "bilinear"):
            raise ValueError(f"image_resample must be bicubic or bilinear, got {self.image_resample!r}")
        if self.feature_norm and self.select_indices != [self.num_layers]:
            raise ValueError("feature_norm reads the post-LayerNorm of the last layer: vision_select_layer must be -1")
        if self.norm_type not in ("layer", "rms"):
            raise ValueError(f"vision norm_type must be layer or rms, got {self.norm_type!r}")
        if not spec.block_options and (self.norm_type, self.qk_norm, self.qkv_bias) != ("layer", False, True):
            raise ValueError(f"a {self.kind} tower takes no norm_type / qk_norm / qkv_bias choice (InternViT's)")
        if spec.check is not None:  # the family's own rules (a merger's input, rotary, windows, position grid)
            spec.check(self)

    @property
    def spec(self) -> TowerSpec:
        """The tower's family (``neva.families``): what generic code asks instead of the kind's name."""
        return tower_spec(self.kind)

    def _fixed(self, what: str) -> None:
        if self.spec.patch_grid:
            raise ValueError(
                f"vision {what}: a {self.kind} tower has no fixed count per image (native resolution); count from "
                "the image's grid (neva.data.qwen_images)"
            )

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch of a native tower: channels × temporal_patch_size × patch_size²."""
        return self.num_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def select_layers(self) -> list[int]:
        layers = self.vision_select_layer
        return list(layers) if isinstance(layers, (list, tuple)) else [layers]

    @property
    def select_indices(self) -> list[int]:
        """``select_layers`` as hidden-state indices: 0 = the embeddings, i = the output of layer i."""
        return [i if i >= 0 else self.num_layers + 1 + i for i in self.select_layers]

    @property
    def layers_run(self) -> int:
        """Layers that run: those up to the deepest selected hidden state (the rest cannot change the features)."""
        return max(self.select_indices)

    @property
    def grid(self) -> int:
        """Patches per side (fixed-size towers only)."""
        self._fixed("grid")
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        self._fixed("num_patches")
        return self.grid**2

    @property
    def class_tokens(self) -> int:
        """Class tokens the tower prepends to its patches (CLIP 1, SigLIP 0)."""
        return self.spec.class_tokens

    @property
    def seq_len(self) -> int:
        """Tokens inside the tower (patches and class tokens): the rows its blocks multiply."""
        self._fixed("seq_len")
        return self.num_patches + self.class_tokens

    @property
    def num_image_tokens(self) -> int:
        """Feature tokens per image handed to the projector (``NevaConfig.num_image_tokens``: after it)."""
        self._fixed("num_image_tokens")
        return self.num_patches + (self.class_tokens if self.vision_select_feature == "cls_patch" else 0)

    @property
    def feature_size(self) -> int:
        """Width of the features handed to the projector."""
        return self.hidden_size * len(self.select_layers)


@dataclass
class LLMConfig:
    """The one Llama-family decoder; families (Llama-2/3, Mistral, Qwen2) differ only in these fields."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int | None = None  # None = num_heads (MHA); fewer = GQA
    head_dim: int | None = None  # None = hidden_size // num_heads
    rope_theta: float = 10000.0
    # None, {"rope_type": "linear", "factor": f} or Llama-3's {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"} (HF ``rope_scaling`` / ``rope_parameters`` fields).
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    max_seq_len: int = 4096
    tie_word_embeddings: bool = False
    # Family variations (HF ``model_type`` and the fields that set them: docs/INTEROP.md "Decoder families").
    # llama | mistral | qwen2 | qwen3 | mixtral, qwen3_moe (MoE): the HF model_type an export writes
    family: str = "llama"
    qkv_bias: bool = False  # biased q/k/v projections (Qwen2; HF Llama ``attention_bias``)
    o_bias: bool = False  # biased attention output projection (HF Llama ``attention_bias``)
    mlp_bias: bool = False  # biased gate/up/down projections (HF Llama ``mlp_bias``)
    # Each query attends to itself and the window - 1 tokens before it (Mistral v0.1 ``sliding_window``); None = all.
    sliding_window: int | None = None
    # Mixture of experts (NeMo / Megatron-Core names; neva/models/moe.py). None = a dense SwiGLU feed-forward in
    # every block; N = every block's feed-forward is N SwiGLU experts of width ``intermediate_size`` behind a router.
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    # Which load-balancing loss ``moe_aux_loss_coeff`` scales: ``megatron`` (Megatron-Core's Switch loss, NeMo's) or
    # ``hf`` (transformers' ``load_balancing_loss_func``); formulas in neva/models/moe.py.
    moe_aux_loss_formula: str = "megatron"
    # Per-head RMSNorm of q and k before RoPE (Qwen3's ``q_norm`` / ``k_norm``, weights ``[head_dim]``).
    qk_norm: bool = False
    # M-RoPE (Qwen2-VL and after): how many of the ``head_dim / 2`` rotary frequencies the time, height and width
    # position axes drive (HF ``rope_parameters["mrope_section"]``); None = one-axis RoPE. Consecutive blocks
    # (Qwen2-VL, Qwen2.5-VL) or, with ``mrope_interleaved``, Qwen3-VL's t, h, w, t, h, w, ... layout
    # (neva/models/rope.py).
    mrope_section: list[int] | None = None
    mrope_interleaved: bool = False
    # Gemma 3 (neva/families/gemma3.py: the family's traits beyond these fields). ``layer_types``: per layer
    # ``sliding_attention`` (``sliding_window`` applies, RoPE base ``rope_local_theta``) or ``full_attention``; None:
    # every layer alike. ``query_pre_attn_scalar``: attention scores scaled by its -1/2 power (None: head_dim's).
    # ``final_logit_softcapping``: logits → c·tanh(logits / c).
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # Hybrid decoders (Qwen3.5; Megatron-Core names): linear-attention layers among the full-attention ones (None:
    # none), a sigmoid output gate per query channel (``wq`` holds each head's query then its gate), RoPE on the
    # first ``rotary_percent`` of each head, norms scaling by ``1 + weight``, and beside the routed experts a shared
    # SwiGLU expert of this width, behind a sigmoid gate (``moe_shared_expert_gate``).
    linear_attention: LinearAttentionConfig | None = None
    attention_output_gate: bool = False
    rotary_percent: float = 1.0
    layernorm_zero_centered_gamma: bool = False
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    # Llama 4 (neva/families/llama4.py). ``layer_types`` may name ``chunked_attention`` layers: a query sees the keys
    # of its own ``attention_chunk_size``-token chunk of its sample (chunks counted from the sample's first token, as
    # HF counts them from a row's first unpadded token). ``nope_layers``: the layers that take no RoPE (NoPE).
    # ``qk_l2_norm``: on the RoPE layers, q and k RMS-normalised per head without a weight. On the NoPE layers, with
    # ``attn_temperature_floor_scale`` f, each query at position p is scaled by 1 + s·log1p(floor((p + 1) / f)),
    # s = ``attn_temperature_scale`` (None: no scaling).
    attention_chunk_size: int | None = None
    nope_layers: list[int] | None = None
    qk_l2_norm: bool = False
    attn_temperature_floor_scale: int | None = None
    attn_temperature_scale: float = 0.1
    # Interleaved MoE (Llama 4; Megatron-Core's list form of ``moe_layer_freq``): per layer 1 (experts) or 0 (a dense
    # SwiGLU of width ``dense_intermediate_size``, None: ``intermediate_size``); None: every layer's feed-forward is
    # the experts. The router's score: ``softmax`` (top-k of the softmax, renormalised: Mixtral) or ``sigmoid`` (the
    # sigmoid of each top-k logit: Llama 4); ``moe_apply_probs_on_input``: the score scales the expert's input, not
    # its output (Megatron-Core's names).
    moe_layer_freq: list[int] | None = None
    dense_intermediate_size: int | None = None
    moe_router_score_function: str = "softmax"
    moe_apply_probs_on_input: bool = False

    def __post_init__(self) -> None:
        spec = decoder_spec(self.family)
        check_decoder_fields(self)
        if spec.check is not None:  # the family's own rules
            spec.check(self)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {self.sliding_window}")
        if spec.moe and not self.is_moe:
            raise ValueError(f"LLM family {self.family} needs num_moe_experts")
        self._check_moe()
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if isinstance(self.linear_attention, dict):  # a preset's or an override's plain form
            self.linear_attention = LinearAttentionConfig(**self.linear_attention)
        if self.linear_attention is not None and len(self.linear_attention.layer_types) != self.num_layers:
            raise ValueError(
                f"linear_attention.layer_types names {len(self.linear_attention.layer_types)} layers, the decoder "
                f"has {self.num_layers}"
            )
        if not 0 < self.rotary_percent <= 1 or self.rotary_dim % 2:
            raise ValueError(f"rotary_percent {self.rotary_percent} of head_dim {self.head_dim}: need an even share")
        self._check_mrope()
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type", "default") not in (
            "default",
            "linear",
            "llama3",
        ):
            raise ValueError(f"unsupported rope_scaling {self.rope_scaling}; supported: linear, llama3")

    def _check_mrope(self) -> None:
        if self.mrope_section is None:
            if self.mrope_interleaved:
                raise ValueError("mrope_interleaved needs mrope_section")
            return
        self.mrope_section = list(self.mrope_section)
        if len(self.mrope_section) != 3 or min(self.mrope_section) < 0:
            raise ValueError(f"mrope_section must be 3 non-negative counts (t, h, w), got {self.mrope_section}")
        if sum(self.mrope_section) != self.rotary_dim // 2:
            raise ValueError(
                f"mrope_section {self.mrope_section} sums to {sum(self.mrope_section)}, not "
                f"{'head_dim' if self.rotary_percent == 1 else 'rotary_dim'} / 2 = {self.rotary_dim // 2} rotary "
                "frequencies"
            )
        h, w = self.mrope_section[1:]
        if self.mrope_interleaved and (3 * h - 1 > self.rotary_dim // 2 or 3 * w > self.rotary_dim // 2):
            # Qwen3-VL's layout puts h at frequencies 1, 4, 7, ... and w at 2, 5, 8, ...: each must fit.
            raise ValueError(
                f"interleaved mrope_section {self.mrope_section}: h and w take every third of the "
                f"{self.rotary_dim // 2} rotary frequencies, which cannot hold {h} and {w}"
            )

    def _check_moe(self) -> None:
        if self.num_moe_experts is None:
            return
        if self.num_moe_experts < 1 or not 1 <= self.moe_router_topk <= self.num_moe_experts:
            raise ValueError(
                f"num_moe_experts {self.num_moe_experts} and moe_router_topk {self.moe_router_topk}: need "
                "1 <= moe_router_topk <= num_moe_experts"
            )
        if self.moe_aux_loss_formula not in ("megatron", "hf"):
            raise ValueError(f"moe_aux_loss_formula must be megatron or hf, got {self.moe_aux_loss_formula!r}")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(
                f"moe_router_score_function must be softmax or sigmoid, got {self.moe_router_score_function!r}"
            )
        if self.moe_layer_freq is not None:
            self.moe_layer_freq = [int(f) for f in self.moe_layer_freq]
            if len(self.moe_layer_freq) != self.num_layers or set(self.moe_layer_freq) - {0, 1}:
                raise ValueError(f"moe_layer_freq must be {self.num_layers} flags of 0 / 1, got {self.moe_layer_freq}")

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.rotary_percent)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer``'s feed-forward is the experts (``moe_layer_freq``)."""
        return self.is_moe and (self.moe_layer_freq is None or bool(self.moe_layer_freq[layer]))

    def uses_rope(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` rotates q and k (every layer but ``nope_layers``)."""
        return self.nope_layers is None or layer not in self.nope_layers

    @property
    def dense_width(self) -> int:
        """The SwiGLU width of a dense (non-MoE) layer."""
        return self.dense_intermediate_size or self.intermediate_size

    def is_linear_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is linear attention (``linear_attention.layer_types``)."""
        return self.linear_attention is not None and self.linear_attention.is_linear(layer)


_PROJECTOR_TYPE = re.compile(r"^(linear|identity|mlp(\d+)x_gelu|mlp_downsample|gemma3|mlp_pixel_shuffle)$")
# Projectors that merge each 2×2 block of the patch grid into one token before a LayerNorm and two Linear layers.
_MERGE_2X2 = ("mlp_downsample", "mlp_pixel_shuffle")


@dataclass
class ProjectorConfig:
    """Vision→LLM projector: ``linear``, ``identity``, ``mlp{N}x_gelu`` (LLaVA's ``mm_projector_type``) or
    ``mlp_downsample`` (NeMo's, from VILA: 2×2 neighbouring patches merged into one token, LayerNorm, 2-layer MLP),
    ``mlp_pixel_shuffle`` (InternVL's: the same merge in row-major token order, HF ``pixel_shuffle`` at ratio 0.5),
    or a native tower's patch merger (``neva.families.MERGERS``: norm, ``spatial_merge_size``² consecutive patches as
    one vector,
    Linear, GELU, Linear; HF ``Qwen2VL`` ``PatchMerger`` & co.)."""

    type: str = "mlp2x_gelu"
    input_size: int = 1024
    output_size: int = 4096
    bias: bool = True
    # Mergers only: patches per side of a merged token, and the DeepStack mergers beside it (qwen3_vl_merger).
    spatial_merge_size: int = 2
    deepstack_mergers: int = 0
    # gemma3 only (neva/models/projector_gemma3.py): tokens an image is pooled to (HF ``mm_tokens_per_image``) and
    # the epsilon of its RMSNorm (HF: the vision config's ``layer_norm_eps``).
    tokens_per_image: int | None = None
    norm_eps: float = 1e-6
    # A merger whose SwiGLU is as wide as the decoder's (``MergerSpec.decoder_width``, GLM-4.1V's): that width.
    intermediate_size: int | None = None

    def __post_init__(self) -> None:
        merger = merger_spec(self.type)
        if (merger is not None and merger.merger.decoder_width) != (self.intermediate_size is not None):
            raise ValueError(
                f"projector intermediate_size is the SwiGLU width of a merger that has one: set it for such a merger "
                f"and only for it (type {self.type})"
            )
        if merger is not None:
            if self.deepstack_mergers and not merger.merger.deepstack:
                raise ValueError(f"projector {self.type} has no DeepStack mergers (deepstack_mergers must be 0)")
            return
        if not _PROJECTOR_TYPE.match(self.type):
            raise ValueError(
                "projector type must be linear, identity, mlp<N>x_gelu, mlp_downsample, mlp_pixel_shuffle or one of "
                f"{', '.join(MERGERS)}, got {self.type!r}"
            )
        if self.type == "identity" and self.input_size != self.output_size:
            raise ValueError("identity projector needs input_size == output_size")

    @property
    def depth(self) -> int:
        """Number of Linear layers."""
        match = _PROJECTOR_TYPE.match(self.type)
        if self.type in _MERGE_2X2 or self.type in MERGERS:
            return 2
        if self.type == "gemma3":
            return 1
        return int(match.group(2)) if match.group(2) else (0 if self.type == "identity" else 1)

    def num_tokens(self, vision: VisionConfig) -> int:
        """LLM positions one image occupies after this projector: the tower's feature tokens, or for
        ``mlp_downsample`` one per 2×2 block of the patch grid, an odd side padded up (NeMo: ceil(side / 2)²). A merger
        has no fixed count (native resolution): an image's comes from its grid."""
        if self.type in MERGERS:
            raise ValueError(
                f"projector {self.type}: no fixed count per image (native resolution); count from its grid"
            )
        if self.type == "mlp_downsample":
            return (-(-vision.grid // 2)) ** 2
        if self.type == "gemma3":
            return self.tokens_per_image
        if self.type == "mlp_pixel_shuffle":
            if vision.grid % 2 or vision.vision_select_feature != "patch":
                raise ValueError(
                    f"mlp_pixel_shuffle merges 2×2 blocks of the patch grid: it needs an even grid (got "
                    f"{vision.grid}) and vision_select_feature patch"
                )
            return (vision.grid // 2) ** 2
        return vision.num_image_tokens


def merger_fields(vision: VisionConfig, llm: LLMConfig) -> dict[str, Any]:
    """The ``ProjectorConfig`` fields a tower's patch merger takes from the tower (its merge, one DeepStack merger per
    DeepStack block) and, where its family says so (``MergerSpec``), from the decoder (its norm's epsilon, its
    SwiGLU's width); none for a tower whose family has no merger."""
    merger = vision.spec.merger
    if merger is None:
        return {}
    fields: dict[str, Any] = dict(
        spatial_merge_size=vision.spatial_merge_size, deepstack_mergers=len(vision.deepstack_visual_indexes)
    )
    if merger.decoder_eps:
        fields["norm_eps"] = llm.rms_norm_eps
    if merger.decoder_width:
        fields.update(intermediate_size=llm.intermediate_size, bias=False)
    return fields


@dataclass
class NevaConfig:
    """The whole model. ``vision`` may be None for a text-only LLM."""

    llm: LLMConfig = field(default_factory=LLMConfig)
    vision: VisionConfig | None = field(default_factory=VisionConfig)
    projector: ProjectorConfig | None = field(default_factory=ProjectorConfig)
    image_token_id: int = 32000
    # LLaVA-NeXT dynamic resolution (image_grid_pinpoints / mm_patch_merge_type); None: one fixed-size tile per image.
    anyres: AnyResConfig | None = None
    # Video (frames through the tower, pooled per frame); None: the model takes no video.
    video: VideoConfig | None = None
    # The id a ``<video>`` placeholder expands to (transformers' ``video_token_index``); None: ``image_token_id``
    # (the collator's video positions tell the two kinds apart).
    video_token_id: int | None = None
    # Tokens a family's image text puts between and after its image tokens (Pixtral's ``[IMG_BREAK]`` after each row
    # of tokens, ``[IMG_END]`` last: ``neva.data.pixtral_images``); None where the family writes none.
    image_break_token_id: int | None = None
    image_end_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("image_break_token_id", "image_end_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.llm.vocab_size:
                raise ValueError(f"{name} {value} outside vocab of size {self.llm.vocab_size}")
        if self.video is not None and self.vision is None:
            raise ValueError("video needs a vision tower")
        if self.video is not None and self.video.spatial_pool_stride > 1:
            # The pool views a frame's features as the tower's square patch grid (transformers' pooler does too).
            if self.vision.vision_select_feature != "patch":
                raise ValueError("video spatial pooling needs vision_select_feature=patch (no class token in the grid)")
            if self.projector is not None and self.projector.type in _MERGE_2X2:
                raise ValueError(
                    f"video spatial pooling and {self.projector.type} both merge the grid: use one (stride 1)"
                )
        if self.video_token_id is not None and not 0 <= self.video_token_id <= self.llm.vocab_size:
            raise ValueError(f"video_token_id {self.video_token_id} outside vocab of size {self.llm.vocab_size}")
        if self.anyres is not None:
            if self.vision is None:
                raise ValueError("anyres needs a vision tower")
            self.anyres.check_tile(self.vision.image_size)
            if self.anyres.patch_merge_type != "flat" and self.vision.vision_select_feature != "patch":
                raise ValueError(
                    f"mm_patch_merge_type={self.anyres.patch_merge_type} lays each tile's patch grid out in space: "
                    "vision_select_feature must be patch (a class token has no place in the grid)"
                )
        if self.vision is not None and self.projector is not None:
            self._check_merger()
            if self.projector.type == "gemma3":
                check_gemma3_projector(self.projector.tokens_per_image, self.vision.grid)
            if self.projector.type == "mlp_downsample" and self.vision.vision_select_feature == "cls_patch":
                raise ValueError(
                    "mlp_downsample merges 2x2 blocks of the patch grid: vision_select_feature=cls_patch adds a "
                    "class token outside the grid (use patch)"
                )
            if self.projector.type == "mlp_pixel_shuffle":
                self.projector.num_tokens(self.vision)  # its grid rule (even, patches only), checked at construction
            if self.projector.input_size != self.vision.feature_size:
                raise ValueError(
                    f"projector input_size {self.projector.input_size} != vision feature size {self.vision.feature_size}"
                )
            if self.projector.output_size != self.llm.hidden_size:
                raise ValueError(
                    f"projector output_size {self.projector.output_size} != LLM hidden_size {self.llm.hidden_size}"
                )
        # image_token_id == vocab_size: the image token has no embedding or LM-head row (LLaVA's own models splice at
        # id -200 and have none), so the softmax has exactly the source model's classes (docs/INTEROP.md).
        if not 0 <= self.image_token_id <= self.llm.vocab_size:
            raise ValueError(f"image_token_id {self.image_token_id} outside vocab of size {self.llm.vocab_size}")

    def _check_merger(self) -> None:
        """A native tower takes its own merger, and a merger its tower: the merge and DeepStack counts agree."""
        merger = merger_spec(self.projector.type)
        if merger is None and not self.vision.spec.patch_grid:
            return
        if merger is None or merger.kind != self.vision.kind:
            pairs = ", ".join(f"{m.kind}: {t}" for t, m in MERGERS.items())
            raise ValueError(
                f"vision kind {self.vision.kind} and projector type {self.projector.type} do not go together (a "
                f"native tower takes its merger: {pairs})"
            )
        if self.projector.spatial_merge_size != self.vision.spatial_merge_size:
            raise ValueError(
                f"projector spatial_merge_size {self.projector.spatial_merge_size} != vision spatial_merge_size "
                f"{self.vision.spatial_merge_size}"
            )
        if merger.merger.deepstack and self.projector.deepstack_mergers != len(self.vision.deepstack_visual_indexes):
            raise ValueError(
                f"projector deepstack_mergers {self.projector.deepstack_mergers} != the vision tower's "
                f"{len(self.vision.deepstack_visual_indexes)} deepstack_visual_indexes"
            )

    @property
    def deepstack_layers(self) -> int:
        """Decoder layers (0, 1, ...) after which DeepStack features join the residual stream (Qwen3-VL; else 0): one
        per DeepStack merger, as far as the decoder reaches (HF's, too, leaves mergers past its depth unused)."""
        if self.vision is None or self.projector is None:
            return 0
        return min(self.projector.deepstack_mergers, self.llm.num_layers)

    @property
    def num_image_tokens(self) -> int:
        if self.vision is None:
            return 0
        return self.vision.num_image_tokens if self.projector is None else self.projector.num_tokens(self.vision)

    @property
    def image_token_has_row(self) -> bool:
        """Whether ``image_token_id`` has its own embedding and LM-head row (False: it is ``vocab_size``)."""
        return self.image_token_id < self.llm.vocab_size

    def image_tokens(self, size: tuple[int, int] | None) -> int:
        """Decoder positions of one image of ``size`` (height, width); None = a fixed-size image. Without AnyRes,
        every image takes ``num_image_tokens``; with it, ``neva.models.anyres.image_token_count`` (the one rule)."""
        if self.anyres is None:
            return self.num_image_tokens
        return image_token_count(self.anyres, self.num_image_tokens, self.vision.image_size, size)

    @property
    def video_token(self) -> int:
        return self.image_token_id if self.video_token_id is None else self.video_token_id

    @property
    def patch_video(self) -> bool:
        """A native-resolution model takes video (frames as temporal patches through the same tower and merger, no
        frame pooling) exactly when it has its own video token id (HF ``video_token_id``, set by the import)."""
        return (
            self.vision is not None
            and self.vision.spec.video is not None
            and self.video_token_id is not None
            and self.video_token_id != self.image_token_id
        )

    @property
    def takes_video(self) -> bool:
        """LLaVA-style pooled frames (``video``) or a native model's temporal patches (``patch_video``)."""
        return self.video is not None or self.patch_video

    def video_tokens(self, frames: int) -> int:
        """Decoder positions of one video of ``frames`` sampled frames (``neva.models.video.video_token_count``)."""
        if self.video is None:
            raise ValueError("this model takes no video (model.video is not set)")
        return video_token_count(self.video, self.vision.grid, frames, self.num_image_tokens)
