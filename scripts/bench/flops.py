"""Model FLOPs of one training sample, counting frozen weights as the work they really need.

Per token and weight: the forward costs 2 FLOPs; backward through the weight to its input 2 more; the weight's own
gradient 2 more. Hence:

* a trained weight: 6 per token;
* a frozen weight that gradients must cross (the frozen LLM in pretraining: the trained projector sits before it):
  4 per token, no weight gradient;
* a frozen part nothing upstream of it trains (the vision tower): 2 per token, forward only.

Attention scores and the weighted sum add ``4 · T · d`` per layer per token in the forward (``T`` = the sample's
own length, ``d`` = heads × head dim; the causal half is not discounted, as in Megatron's count); the backward
computes only input gradients there (no weights), ``2×`` the forward, so ``×3`` in all whenever gradients cross
the layer, ``×1`` otherwise. Embedding lookups cost nothing; the LM head is a weight like any other. Padding is
not counted: FLOPs spent on padding are waste, not model FLOPs.
"""

from __future__ import annotations

from torch import nn

from neva.models.config import NevaConfig


def _split(module: nn.Module | None, skip: tuple[str, ...] = ()) -> tuple[int, int]:
    """(trained, frozen) parameter counts of ``module``, leaving out parameters whose name starts with ``skip``."""
    trained = frozen = 0
    if module is None:
        return 0, 0
    for name, p in module.named_parameters():
        if name.startswith(skip):
            continue
        if p.requires_grad:
            trained += p.numel()
        else:
            frozen += p.numel()
    return trained, frozen


def sample_flops(model: nn.Module, cfg: NevaConfig, seq_len: int, images: int) -> dict[str, float]:
    """FLOPs of forward + backward for one sample, by part.

    Args:
        model: the NevaModel with ``requires_grad`` set by the stage's freeze policy (meta tensors are fine).
        cfg: its config.
        seq_len: the sample's LLM positions, image positions included, padding excluded.
        images: images in the sample.

    Returns:
        ``{"llm", "projector", "vision", "total"}`` in FLOPs.
    """
    vision_trains = model.vision is not None and any(p.requires_grad for p in model.vision.parameters())
    proj_trained, proj_frozen = _split(model.projector)
    llm_trained, llm_frozen = _split(model.llm, skip=("tok_embeddings",))
    # Gradients cross the LLM when anything in or before it trains (embedding rows included).
    emb = model.llm.tok_embeddings
    crossing = vision_trains or proj_trained > 0 or llm_trained > 0 or (emb is not None and emb.weight.requires_grad)
    llm = seq_len * (6 * llm_trained + (4 if crossing else 2) * llm_frozen)
    d = cfg.llm.num_heads * cfg.llm.head_dim
    llm += (3 if crossing else 1) * 4 * seq_len * seq_len * d * cfg.llm.num_layers

    out = {"llm": float(llm), "projector": 0.0, "vision": 0.0}
    if cfg.vision is not None and images:
        v = cfg.vision
        img_tokens = images * v.num_image_tokens
        out["projector"] = float(img_tokens * (6 * proj_trained + (4 if vision_trains else 2) * proj_frozen))
        # Only the layers up to the deepest selected hidden state run (neva skips the rest; see VisionTower.features).
        layers_run = max(i if i >= 0 else v.num_layers + 1 + i for i in v.select_layers)
        per_layer = 4 * v.hidden_size * v.hidden_size + 2 * v.hidden_size * v.intermediate_size
        tokens = v.num_patches + 1
        patch = v.num_channels * v.patch_size * v.patch_size * v.hidden_size
        mult = 3 if vision_trains else 1
        fwd = tokens * (2 * per_layer * layers_run) + v.num_patches * 2 * patch
        fwd += 4 * tokens * tokens * v.hidden_size * layers_run
        out["vision"] = float(images * fwd * mult)
    out["total"] = out["llm"] + out["projector"] + out["vision"]
    return out
