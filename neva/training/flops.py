"""Training FLOPs of a batch, counting frozen parts correctly.

Per token and weight: the forward costs 2 FLOPs, the gradient with respect to the layer's input 2 more, the weight
gradient 2 more. A trained weight therefore costs 6; a frozen weight that gradients must cross on their way to
something trainable costs 4 (a frozen LLM in pretraining: the loss sits behind it, the projector before it); a frozen
part that nothing needs gradients from (a frozen vision tower, first in line) costs 2. Attention scores and
weighted values add ``4 · S · d`` per token and layer in the forward (``S`` = the sample's length, no causal
discount, as Megatron counts), times 3 when gradients cross the layer (attention has no weights: its input
gradient alone costs two forwards), 1 for forward only.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from neva.models.config import NevaConfig


@dataclass(frozen=True)
class ParamProfile:
    """(trainable, frozen) parameter counts per part; the embedding lookup is not counted (it is no matmul)."""

    vision: tuple[int, int]
    projector: tuple[int, int]
    llm: tuple[int, int]

    @classmethod
    def of(cls, model: nn.Module) -> ParamProfile:
        llm_trained, llm_frozen = _params(model.llm)
        emb = model.llm.tok_embeddings
        if emb is not None:
            if emb.weight.requires_grad:
                llm_trained -= emb.weight.numel()
            else:
                llm_frozen -= emb.weight.numel()
        return cls(_params(model.vision), _params(model.projector), (llm_trained, llm_frozen))


def _params(module: nn.Module | None) -> tuple[int, int]:
    if module is None:
        return 0, 0
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return trained, sum(p.numel() for p in module.parameters()) - trained


def train_flops(profile: ParamProfile, cfg: NevaConfig, seq_lens: list[int], images: int) -> float:
    """Forward + backward FLOPs of one batch.

    Args:
        profile: parameter counts of the unsharded model with ``requires_grad`` set by the freeze policy.
        cfg: its config.
        seq_lens: LLM length of each sample (image positions included, padding excluded).
        images: images in the batch.
    """
    tokens = sum(seq_lens)
    vision_trained, vision_frozen = profile.vision
    projector_trained, projector_frozen = profile.projector
    llm_trained, llm_frozen = profile.llm
    crossing = vision_trained + projector_trained + llm_trained > 0
    flops = tokens * (6 * llm_trained + (4 if crossing else 2) * llm_frozen)
    attn = 3 if crossing else 1  # the input gradient of attention costs 2 forwards, with or without weights
    width = cfg.llm.num_heads * cfg.llm.head_dim
    flops += attn * 4 * sum(s * s for s in seq_lens) * width * cfg.llm.num_layers
    if cfg.vision is not None and images:
        v = cfg.vision
        image_tokens = images * v.num_image_tokens
        flops += image_tokens * (6 * projector_trained + (4 if vision_trained else 2) * projector_frozen)
        patches = v.num_patches + 1
        flops += images * patches * (6 * vision_trained + 2 * vision_frozen)
        flops += (3 if vision_trained else 1) * 4 * images * patches * patches * v.hidden_size * v.num_layers
    return float(flops)


PEAK_TFLOPS_BF16 = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def device_peak_tflops(device_name: str | None, configured: float | None = None) -> float | None:
    """Dense bf16 peak of the device (datasheet), or the configured ``cluster.peak_tflops_bf16``."""
    if configured:
        return configured
    if not device_name:
        return None
    return next((v for k, v in PEAK_TFLOPS_BF16.items() if k in device_name), None)
