"""InternViT (InternVL 3 / 3.5's tower; HF ``InternVLVisionModel``) at a fixed resolution.

What differs from CLIP's blocks: a per-channel learned scale on each residual branch (HF ``lambda_1`` /
``lambda_2``: layer scale), the blocks' norm by the config (``norm_type``: LayerNorm for InternViT-300M, RMSNorm for
InternViT-6B), biased or bias-free q / k / v (``qkv_bias``) and, for the 6B tower, an RMSNorm of q and of k over the
whole width before the heads split (``qk_norm``; eps 1e-6 whatever ``layer_norm_eps`` says, as HF). Like CLIP: a
class token and one learned position per patch plus one, a biased patch convolution, no pre-LayerNorm. There is no
post-LayerNorm (HF's is an Identity under ``use_mean_pooling``, the only value the import accepts), so LLaVA's
selection reads the blocks' outputs unchanged and InternVL's features (``vision_feature_layer`` -1, ``default``
strategy) are the last block's patches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from neva.models.config import VisionConfig
from neva.models.native_vision import make_norm
from neva.models.vision import VisionMLP, as_pixels, encoder_states, no_pixels, select_features

QK_NORM_EPS = 1e-6  # HF InternVLVisionRMSNorm's default: its q / k norms are built without the config's eps


class InternAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        width = cfg.hidden_size
        self.head_dim = width // cfg.num_heads
        self.q_proj = nn.Linear(width, width, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(width, width, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(width, width, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(width, width)
        self.q_norm = make_norm("rms", width, QK_NORM_EPS) if cfg.qk_norm else None
        self.k_norm = make_norm("rms", width, QK_NORM_EPS) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:  # over the whole width: every head's share of one statistic
            q, k = self.q_norm(q), self.k_norm(k)
        heads = q.shape[-1] // self.head_dim
        q, k, v = (t.view(b, s, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class InternBlock(nn.Module):
    """``x + λ1 · attn(norm1(x))``, then ``x + λ2 · mlp(norm2(x))``."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = make_norm(cfg.norm_type, cfg.hidden_size, cfg.layer_norm_eps)
        self.attn = InternAttention(cfg)
        self.lambda_1 = nn.Parameter(torch.empty(cfg.hidden_size))
        self.norm2 = make_norm(cfg.norm_type, cfg.hidden_size, cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)
        self.lambda_2 = nn.Parameter(torch.empty(cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attn(self.norm1(x))
        return x + self.lambda_2 * self.mlp(self.norm2(x))


class InternViT(nn.Module):
    """The tower interface (``hidden_states``, ``features``, ``empty_input``, ``init_weights``) over InternViT."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size, bias=True)
        self.cls_token = nn.Parameter(torch.empty(cfg.hidden_size))
        self.pos_embed = nn.Embedding(cfg.num_patches + 1, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): InternBlock(cfg) for i in range(cfg.num_layers)})

    def hidden_states(self, pixel_values: torch.Tensor, num_layers: int | None = None) -> list[torch.Tensor]:
        """HF ``hidden_states``: index 0 = class token and patches plus positions, index i = output of layer i."""
        pixel_values = as_pixels(pixel_values, self.cfg, self.patch_embed.weight.dtype)
        patches = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)
        cls = self.cls_token.to(patches.dtype).expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1) + self.pos_embed.weight.to(patches.dtype)
        return encoder_states(x, self.layers, self.cfg.num_layers if num_layers is None else num_layers)

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, num_image_tokens, feature_size]``: the selected hidden state(s), the class token dropped."""
        return select_features(self, pixel_values)

    def empty_input(self, device: torch.device) -> torch.Tensor:
        return no_pixels(self.cfg, device)

    def init_weights(self) -> None:
        """HF ``_init_weights``: Linear and convolution normal(0.02) with zero biases, norms reset, the class token
        and positions zero (as HF's), the layer scales at HF's ``layer_scale_init_value`` default 0.1."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif hasattr(module, "reset_parameters") and not isinstance(module, nn.Embedding):
                module.reset_parameters()
        nn.init.zeros_(self.cls_token)
        nn.init.zeros_(self.pos_embed.weight)
        for block in self.layers.values():
            nn.init.constant_(block.lambda_1, 0.1)
            nn.init.constant_(block.lambda_2, 0.1)
