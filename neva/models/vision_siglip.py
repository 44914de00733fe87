"""SigLIP / SigLIP2 ViT at a fixed resolution (the HF ``SiglipVisionModel`` computation, without the pooling head).

What differs from CLIP: no class token, no pre-LayerNorm, a biased patch convolution, one learned position per patch,
tanh-GELU in the MLP (``gelu_pytorch_tanh``, from the config). The blocks are CLIP's pre-LN blocks unchanged (same
key names in HF too). ``post_norm`` exists only so checkpoints round-trip: HF's ``hidden_states[-1]`` is the last
block's output before ``post_layernorm``, and LLaVA reads ``hidden_states``. The attention-pooling ``head`` (SigLIP's
contrastive image embedding) is never run by LLaVA: import drops its tensors and export writes ``vision_use_head:
false``.
"""

from __future__ import annotations

import torch
from torch import nn

from neva.models.config import VisionConfig
from neva.models.vision import VisionBlock, as_pixels, encoder_states, init_vit_weights, no_pixels, select_features


class SiglipTower(nn.Module):
    """SigLIP ViT behind the tower interface (``hidden_states``, ``features``, ``empty_input``, ``init_weights``)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_patches, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): VisionBlock(cfg) for i in range(cfg.num_layers)})
        self.post_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def hidden_states(self, pixel_values: torch.Tensor, num_layers: int | None = None) -> list[torch.Tensor]:
        """HF ``hidden_states``: index 0 = patch + position embeddings, index i = output of layer i."""
        pixel_values = as_pixels(pixel_values, self.cfg, self.patch_embed.weight.dtype)
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2) + self.pos_embed.weight.to(pixel_values.dtype)
        return encoder_states(x, self.layers, self.cfg.num_layers if num_layers is None else num_layers)

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, num_patches, feature_size]``: every patch (there is no class token to drop)."""
        return select_features(self, pixel_values)

    def empty_input(self, device: torch.device) -> torch.Tensor:
        return no_pixels(self.cfg, device)

    def init_weights(self) -> None:
        init_vit_weights(self)
