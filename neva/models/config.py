"""Typed model configs: vision encoder, LLM decoder, projector and the NeVA glue.

Every config round-trips through a plain dict (``to_dict`` / ``from_dict``); ``from_dict`` rejects unknown keys so a
typo in a checkpoint's ``config.json`` or a Hydra override fails loudly instead of silently using a default.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar

from neva.constants import CLIP_MEAN, CLIP_STD
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
    """CLIP ViT vision encoder (HF ``CLIPVisionConfig`` fields under LLaVA/NeMo names)."""

    image_size: int = 336
    patch_size: int = 14
    num_channels: int = 3
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_layers: int = 24
    num_heads: int = 16
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    # Hidden-state index as in HF ``output_hidden_states`` (0 = embeddings after pre-LN, -1 = last layer); a list
    # concatenates several layers along the feature dimension (HF ``vision_feature_layer`` as a list).
    vision_select_layer: int | list[int] = -2
    vision_select_feature: str = "patch"  # "patch" drops CLS (HF "default"), "cls_patch" keeps it (HF "full")
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.hidden_act not in ("quick_gelu", "gelu"):
            raise ValueError(f"vision hidden_act must be quick_gelu or gelu, got {self.hidden_act!r}")
        if self.vision_select_feature not in ("patch", "cls_patch"):
            raise ValueError(f"vision_select_feature must be patch or cls_patch, got {self.vision_select_feature!r}")
        for layer in self.select_layers:
            if not -(self.num_layers + 1) <= layer <= self.num_layers:
                raise ValueError(f"vision_select_layer {layer} out of range for {self.num_layers} layers")

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
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """LLM positions one image occupies after the projector."""
        return self.num_patches + (1 if self.vision_select_feature == "cls_patch" else 0)

    @property
    def feature_size(self) -> int:
        """Width of the features handed to the projector."""
        return self.hidden_size * len(self.select_layers)


@dataclass
class LLMConfig:
    """Llama-family decoder (Llama-2 / Llama-3 / Mistral shapes)."""

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
    # Mixture of experts (NeMo / Megatron-Core names; neva/models/moe.py). None = a dense SwiGLU feed-forward in
    # every block; N = every block's feed-forward is N SwiGLU experts of width ``intermediate_size`` behind a router.
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    # Which load-balancing loss ``moe_aux_loss_coeff`` scales: ``megatron`` (Megatron-Core's Switch loss, NeMo's) or
    # ``hf`` (transformers' ``load_balancing_loss_func``); formulas in neva/models/moe.py.
    moe_aux_loss_formula: str = "megatron"

    def __post_init__(self) -> None:
        self._check_moe()
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type", "default") not in (
            "default",
            "linear",
            "llama3",
        ):
            raise ValueError(f"unsupported rope_scaling {self.rope_scaling}; supported: linear, llama3")

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

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None


_PROJECTOR_TYPE = re.compile(r"^(linear|identity|mlp(\d+)x_gelu)$")


@dataclass
class ProjectorConfig:
    """Vision→LLM projector: ``linear``, ``identity`` or ``mlp{N}x_gelu`` (LLaVA's ``mm_projector_type``)."""

    type: str = "mlp2x_gelu"
    input_size: int = 1024
    output_size: int = 4096
    bias: bool = True

    def __post_init__(self) -> None:
        if not _PROJECTOR_TYPE.match(self.type):
            raise ValueError(f"projector type must be linear, identity or mlp<N>x_gelu, got {self.type!r}")
        if self.type == "identity" and self.input_size != self.output_size:
            raise ValueError("identity projector needs input_size == output_size")

    @property
    def depth(self) -> int:
        """Number of Linear layers."""
        match = _PROJECTOR_TYPE.match(self.type)
        return int(match.group(2)) if match.group(2) else (0 if self.type == "identity" else 1)


@dataclass
class NevaConfig:
    """The whole model. ``vision`` may be None for a text-only LLM."""

    llm: LLMConfig = field(default_factory=LLMConfig)
    vision: VisionConfig | None = field(default_factory=VisionConfig)
    projector: ProjectorConfig | None = field(default_factory=ProjectorConfig)
    image_token_id: int = 32000

    def __post_init__(self) -> None:
        if self.vision is not None and self.projector is not None:
            if self.projector.input_size != self.vision.feature_size:
                raise ValueError(
                    f"projector input_size {self.projector.input_size} != vision feature size {self.vision.feature_size}"
                )
            if self.projector.output_size != self.llm.hidden_size:
                raise ValueError(
                    f"projector output_size {self.projector.output_size} != LLM hidden_size {self.llm.hidden_size}"
                )
        if not 0 <= self.image_token_id < self.llm.vocab_size:
            raise ValueError(f"image_token_id {self.image_token_id} outside vocab of size {self.llm.vocab_size}")

    @property
    def num_image_tokens(self) -> int:
        return 0 if self.vision is None else self.vision.num_image_tokens
