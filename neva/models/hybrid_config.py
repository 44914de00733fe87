"""A hybrid decoder's linear-attention layers (Qwen3.5's Gated DeltaNet): which layers they are and their shape.

``LLMConfig.linear_attention`` holds one of these, or None for a decoder whose every layer is full attention. The
names are transformers' ``Qwen3_5TextConfig`` fields (Megatron-Core's for Qwen3-Next are the same): a linear layer
projects ``num_key_heads`` query / key heads of ``key_head_dim`` and ``num_value_heads`` value heads of
``value_head_dim`` (each query / key head serving ``num_value_heads / num_key_heads`` value heads), runs a causal
depthwise convolution of ``conv_kernel_dim`` taps over the concatenated q, k, v, and the gated delta rule over a
``[key_head_dim, value_head_dim]`` state per value head (``neva.models.gated_deltanet``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

LAYER_KINDS = ("full_attention", "linear_attention")


@dataclass
class LinearAttentionConfig:
    # One entry per decoder layer (HF ``layer_types``): full_attention | linear_attention.
    layer_types: list[str] = field(default_factory=list)
    conv_kernel_dim: int = 4
    key_head_dim: int = 128
    value_head_dim: int = 128
    num_key_heads: int = 16
    num_value_heads: int = 32

    def __post_init__(self) -> None:
        self.layer_types = list(self.layer_types)
        bad = sorted({t for t in self.layer_types if t not in LAYER_KINDS})
        if bad:
            raise ValueError(f"linear_attention layer_types must be {' or '.join(LAYER_KINDS)}, got {bad}")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"linear attention num_value_heads {self.num_value_heads} is not a multiple of num_key_heads "
                f"{self.num_key_heads}"
            )
        if self.conv_kernel_dim < 1:
            raise ValueError(f"linear attention conv_kernel_dim must be >= 1, got {self.conv_kernel_dim}")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"
