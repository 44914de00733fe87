"""Vision→LLM projector (LLaVA ``mm_projector``)."""

from __future__ import annotations

from torch import nn

from neva.models.config import ProjectorConfig


def build_projector(cfg: ProjectorConfig) -> nn.Sequential:
    """``linear``, ``identity`` or ``mlp{N}x_gelu`` as an ``nn.Sequential``.

    A Sequential keeps LLaVA's own key names (``0``, ``2``, ... for the Linear layers of ``mlp2x_gelu``), so the
    original LLaVA ``model.mm_projector.{i}`` keys map one to one.
    """
    if cfg.type == "identity":
        return nn.Sequential(nn.Identity())
    layers: list[nn.Module] = [nn.Linear(cfg.input_size, cfg.output_size, bias=cfg.bias)]
    for _ in range(1, cfg.depth):
        layers += [nn.GELU(), nn.Linear(cfg.output_size, cfg.output_size, bias=cfg.bias)]
    return nn.Sequential(*layers)


def init_projector(projector: nn.Sequential) -> None:
    for module in projector:
        if isinstance(module, nn.Linear):
            module.reset_parameters()
