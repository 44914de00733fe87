"""CLIP ViT vision encoder (the HF ``CLIPVisionModel`` computation, pre-LN, without the projection head), and the
pieces every ViT tower shares (pixel normalisation, the pre-LN block, hidden states, LLaVA's feature selection)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from neva.models.config import VisionConfig
from neva.models.layers import ACTIVATIONS


def normalize_pixels(pixels: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 ``[N, C, H, W]`` → CLIP-normalised fp32 ``(x / 255 - mean) / std``, on the pixels' device.

    Data loaders hand over uint8 pixels (a quarter of fp32's bytes through workers, pinned memory and the host-device
    copy); the arithmetic runs here in fp32, where it equals the CPU recipe of ``transformers.CLIPImageProcessor`` to
    fp32 rounding. Per-channel Python scalars keep it free of host-device copies.
    """
    x = pixels.float().div_(255.0)
    return torch.stack([(x[:, c] - mean[c]) / std[c] for c in range(x.shape[1])], dim=1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj))
        # Heads from the projected width: a rank holding a slice of them runs the same code, and an empty batch (a
        # micro-batch without images, neva.models.media) has a shape to view.
        heads = q.shape[-1] // self.head_dim
        q, k, v = (t.view(b, s, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = VisionAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def encoder_states(x: torch.Tensor, layers: nn.ModuleDict, num_layers: int) -> list[torch.Tensor]:
    """HF ``hidden_states`` of a ViT encoder from its embeddings ``x``: index 0 = ``x``, i = output of layer i."""
    states = [x]
    for i in range(num_layers):
        x = layers[str(i)](x)
        states.append(x)
    return states


def select_features(tower: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """What LLaVA feeds the projector (HF ``LlavaModel.get_image_features``): the selected hidden state(s) before any
    post-LayerNorm, concatenated along the features, the class tokens dropped for ``patch`` (a tower without one keeps
    every patch); ``[N, cfg.num_image_tokens, cfg.feature_size]``."""
    cfg = tower.cfg
    states = tower.hidden_states(pixel_values, num_layers=cfg.layers_run)
    feats = torch.cat([states[i] for i in cfg.select_indices], dim=-1)
    if cfg.feature_norm:  # Gemma 3: SigLIP's last_hidden_state
        feats = tower.post_norm(feats)
    return feats[:, cfg.class_tokens :] if cfg.vision_select_feature == "patch" else feats


def no_pixels(cfg: VisionConfig, device: torch.device) -> torch.Tensor:
    """A tower's input holding no image (``[0, C, H, W]`` uint8): what a micro-batch without images runs, so that
    every rank runs the tower (``neva.models.media``)."""
    return torch.zeros(0, cfg.num_channels, cfg.image_size, cfg.image_size, dtype=torch.uint8, device=device)


def reaches_features(cfg: VisionConfig, name: str) -> bool:
    """Whether tower parameter ``name`` (relative to the tower) takes part in ``select_features``: the blocks past the
    last one run (``layers_run``) and the post-LayerNorm do not (unless ``feature_norm``); both tower kinds name them
    alike."""
    parts = name.split(".")
    if parts[0] == "post_norm":
        return cfg.feature_norm
    return not (parts[0] == "layers" and int(parts[1]) >= cfg.layers_run)


def as_pixels(pixel_values: torch.Tensor, cfg: VisionConfig, dtype: torch.dtype) -> torch.Tensor:
    """uint8 pixels normalised with the tower's mean/std (float input is taken as normalised), in ``dtype``."""
    if pixel_values.dtype == torch.uint8:
        pixel_values = normalize_pixels(pixel_values, cfg.image_mean, cfg.image_std)
    return pixel_values.to(dtype)


def init_vit_weights(tower: nn.Module) -> None:
    """Linear layers normal(0.02) with zero biases, LayerNorms reset, positions and patches normal(0.02)."""
    nn.init.normal_(tower.pos_embed.weight, std=0.02)
    nn.init.normal_(tower.patch_embed.weight, std=0.02)
    if tower.patch_embed.bias is not None:
        nn.init.zeros_(tower.patch_embed.bias)
    for module in tower.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()


class VisionTower(nn.Module):
    """CLIP ViT. ``features`` returns what LLaVA feeds the projector: the selected hidden state(s), CLS dropped or kept."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size, bias=False)
        self.cls_token = nn.Parameter(torch.empty(cfg.hidden_size))
        self.pos_embed = nn.Embedding(cfg.num_patches + 1, cfg.hidden_size)
        self.pre_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleDict({str(i): VisionBlock(cfg) for i in range(cfg.num_layers)})
        # Unused by LLaVA features; kept so checkpoints round-trip bit-identically.
        self.post_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def hidden_states(self, pixel_values: torch.Tensor, num_layers: int | None = None) -> list[torch.Tensor]:
        """HF ``hidden_states``: index 0 = embeddings after pre-LN, index i = output of layer i (up to ``num_layers``).

        ``pixel_values``: uint8 pixels (normalised here with the config's mean/std) or already normalised floats.
        """
        pixel_values = as_pixels(pixel_values, self.cfg, self.patch_embed.weight.dtype)
        patches = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)
        cls = self.cls_token.to(patches.dtype).expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1) + self.pos_embed.weight.to(patches.dtype)
        return encoder_states(self.pre_norm(x), self.layers, self.cfg.num_layers if num_layers is None else num_layers)

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, num_image_tokens, feature_size]`` image features for the projector."""
        return select_features(self, pixel_values)

    def empty_input(self, device: torch.device) -> torch.Tensor:
        return no_pixels(self.cfg, device)

    def init_weights(self) -> None:
        nn.init.normal_(self.cls_token, std=self.cfg.hidden_size**-0.5)
        init_vit_weights(self)
