"""FLOPs per sample, counted from the parameter inventory with frozen parts counted correctly.

Per token, a weight matrix of ``n`` elements costs ``2n`` forward, ``2n`` more for the input gradient (needed when
anything upstream trains) and ``2n`` more for its own gradient (when it trains): 6n trained, 4n frozen inside the
backward path, 2n frozen and upstream of everything trained (the vision tower in both NeVA stages runs under
``no_grad``). Attention adds ``4·s·d`` per layer per token forward, ×3 when the backward passes through it.
"""

from __future__ import annotations

from dataclasses import dataclass

from neva.models.config import NevaConfig
from neva.parallel.layout import Layout
from neva.planner.params import ParamInfo, on_stage


@dataclass(frozen=True)
class StageFlops:
    """FLOPs of one pipeline stage for one sample.

    Attributes:
        model: useful FLOPs (each matmul counted once across TP ranks; what MFU divides by).
        per_gpu: what one GPU of the stage executes: TP-sharded parts divided by tp, replicated parts (vision
            tower, norms) in full, plus activation-checkpointing recomputation.
        backward: whether this stage runs a backward pass at all.
    """

    model: float
    per_gpu: float
    backward: bool


def _vision_layers_run(cfg: NevaConfig) -> int:
    n = cfg.vision.num_layers
    return max(i if i >= 0 else n + 1 + i for i in cfg.vision.select_layers)


def _trainable_before(infos: list[ParamInfo]) -> dict[int, bool]:
    """For each decoder layer: does anything before it (vision, projector, embedding, earlier layers) train?"""
    upstream = any(p.trainable for p in infos if p.part in ("vision", "projector", "embedding"))
    layers = sorted({p.layer for p in infos if p.part == "layer"})
    out = {}
    for i in layers:
        out[i] = upstream
        upstream = upstream or any(p.trainable for p in infos if p.layer == i)
    out[-1] = upstream  # after the last layer: the LM head's input gradient
    return out


def stage_flops(
    infos: list[ParamInfo], cfg: NevaConfig, layout: Layout, seq_len: int, layers: list[list[int]]
) -> list[StageFlops]:
    """FLOPs per sample of each pipeline stage for samples of ``seq_len`` tokens with one image each."""
    llm = cfg.llm
    before = _trainable_before(infos)
    layer_trains = {i: any(p.trainable for p in infos if p.layer == i) for i in before if i >= 0}
    attn_dim = llm.num_heads * llm.head_dim
    vision_tokens = cfg.vision.num_patches + 1 if cfg.vision is not None else 0
    image_tokens = cfg.num_image_tokens
    vision_trains = any(p.trainable for p in infos if p.part == "vision")
    run_layers = _vision_layers_run(cfg) if cfg.vision is not None else 0
    result = []
    for stage in range(len(layers)):
        model = per_gpu = 0.0
        backward = False
        for p in infos:
            if not on_stage(p, stage, layers):
                continue
            if p.part == "vision":
                if p.name.startswith("vision.layers.") and int(p.name.split(".")[2]) >= run_layers:
                    continue  # layers above the selected hidden state never run
                if not (p.linear or p.name == "vision.patch_embed.weight"):
                    continue
                flops = 2 * p.numel * vision_tokens * (3 if vision_trains else 1)
            elif p.part == "projector":
                if not p.linear:
                    continue
                flops = 2 * p.numel * image_tokens * (1 + p.trainable + vision_trains)
            elif p.part in ("layer", "output"):
                if not p.linear:
                    continue
                input_grad = before[p.layer if p.part == "layer" else -1] or (
                    p.part == "layer" and layer_trains[p.layer]
                )
                flops = 2 * p.numel * seq_len * (1 + input_grad + p.trainable)
            else:
                continue
            backward = backward or p.trainable or (p.part in ("layer", "output") and input_grad)
            model += flops
            replicated = p.part == "vision" or p.tp_dim is None
            per_gpu += flops if replicated else flops / layout.tp
        for pos, i in enumerate(layers[stage]):
            through = before[i] or layer_trains[i]
            attn = 4 * seq_len * attn_dim * seq_len * (3 if through else 1)
            model += attn
            per_gpu += attn / layout.tp
            if through and checkpointed(layout, pos):
                per_gpu += _recompute(infos, i, seq_len, attn_dim, layout)
        if stage == 0 and cfg.vision is not None:
            attn = 4 * vision_tokens * cfg.vision.hidden_size * vision_tokens * run_layers * (3 if vision_trains else 1)
            model += attn
            per_gpu += attn
        result.append(StageFlops(model=model, per_gpu=per_gpu, backward=backward))
    return result


def checkpointed(layout: Layout, position: int) -> bool:
    """Whether the ``position``-th decoder layer of a stage is activation-checkpointed."""
    if layout.ac is None:
        return False
    return layout.ac_num_layers is None or position < layout.ac_num_layers


def _recompute(infos: list[ParamInfo], layer: int, seq_len: int, attn_dim: int, layout: Layout) -> float:
    """Extra forward FLOPs per GPU that activation checkpointing spends on decoder layer ``layer``."""
    attn = 4 * seq_len * attn_dim * seq_len / layout.tp
    if layout.ac == "selective":
        return attn  # Megatron's selective recompute: only the attention core
    linear = sum(2 * p.numel * seq_len for p in infos if p.layer == layer and p.linear) / layout.tp
    return linear + attn
