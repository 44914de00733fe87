"""One plan: the memory of every pipeline stage's busiest rank and the predicted step time of a composed config."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

from neva.checkpoint.architecture import neva_config_from_mm
from neva.config import TrainConfig
from neva.models.config import NevaConfig
from neva.parallel.precision import Precision
from neva.parallel.run_rules import check_run
from neva.planner.activations import in_flight_microbatches, stage_activation_split
from neva.planner.deployment import Deployment, deployment_from_config
from neva.planner.flops import StageFlops, stage_flops
from neva.planner.hardware import hardware_from_config
from neva.planner.images import image_load
from neva.planner.memory import peak_grad_bytes, rank_state_bytes, working_bytes
from neva.planner.moe import dispatch_bytes, moe_facts
from neva.planner.offload import state_bus_bytes, state_offload
from neva.planner.params import meta_model, model_inventory, stage_layers
from neva.planner.perf import StepTime, step_time
from neva.planner.preference import (
    frozen_inventory,
    reference_bytes,
    rollout_cache_bytes,
    sequence_deployment,
    sequences_per_sample,
)
from neva.stages import stage_spec
from neva.typed import ConfigError


def text_tokens_of(cfg: TrainConfig) -> int:
    """Mean text tokens per sample of the stage's data (its spec's ``text_tokens``: the datasets NVIDIA measured on,
    docs/PLANNER.md "Workload": LCS-558K captions after `plain`, LLaVA-Instruct-150K conversations after
    `vicuna_v1`; a preference pair is two of the latter, neva.planner.preference)."""
    return stage_spec(cfg.stage).text_tokens


def learned_fraction_of(cfg: TrainConfig) -> float:
    """Share of those text tokens that are learned (the spec's ``learned_fraction``: a caption wholly, about half a
    conversation). The LM head runs only there without TP."""
    return stage_spec(cfg.stage).learned_fraction


GiB = 1024**3


@dataclass(frozen=True)
class StageMemory:
    """Bytes on the busiest rank (TP and DP rank 0, which get the largest ``torch.chunk`` pieces) of one stage."""

    stage: int
    layers: int
    params: int
    grads: int
    optimizer: int
    activations: float
    working: float
    overhead: float
    reference: int = 0  # the preference stage's frozen reference copy (neva.planner.preference)
    host: float = 0.0  # bytes the offload knobs keep in host memory instead (neva.planner.offload); not in total
    # the online RL stage's rollout KV cache (neva.planner.preference.rollout_cache_bytes): held while generating,
    # when no activation of the update is, so the peak is the larger of the two
    rollout: float = 0.0

    @property
    def total(self) -> float:
        fixed = self.params + self.grads + self.optimizer + self.reference
        return fixed + max(self.activations + self.working, self.rollout) + self.overhead


@dataclass(frozen=True)
class Plan:
    """Prediction for one deployment (what a table row and a JSON entry show)."""

    deployment: Deployment
    seq_len: int
    gpu_memory_gb: float
    stages: list[StageMemory]
    time: StepTime
    flops_per_sample: float
    samples_per_s: float
    mfu: float
    extra: dict = field(default_factory=dict)

    @property
    def peak(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.gpu_memory_gb * GiB

    def to_dict(self) -> dict:
        """JSON-ready form (bytes in GiB, times in seconds)."""
        peak = self.peak
        return {
            "nodes": self.deployment.nodes,
            "layout": self.deployment.to_dict(),
            "seq_len": self.seq_len,
            "memory_gib": {
                "params": peak.params / GiB,
                "grads": peak.grads / GiB,
                "optimizer": peak.optimizer / GiB,
                "activations": peak.activations / GiB,
                "working": peak.working / GiB,
                "overhead": peak.overhead / GiB,
                "reference": peak.reference / GiB,
                "host": peak.host / GiB,
                "total": peak.total / GiB,
                "stage": peak.stage,
            },
            "stages": [{**asdict(s), "total": s.total} for s in self.stages],
            "fits": self.fits,
            "step_time": asdict(self.time),
            "flops_per_sample": self.flops_per_sample,
            "samples_per_s": self.samples_per_s,
            "mfu": self.mfu,
            **self.extra,
        }


def sample_tokens(cfg: TrainConfig, num_image_tokens: int, text_tokens: int | None) -> int:
    """Tokens one sample occupies: image tokens + text, padded like the collator (multiple of pad_to_multiple_of)."""
    text = text_tokens_of(cfg) if text_tokens is None else text_tokens
    pad = max(1, cfg.model.data.pad_to_multiple_of)
    return -(-(num_image_tokens + text) // pad) * pad


def budget_deployment(dep: Deployment, seq: int, budget: int) -> Deployment:
    """``dep`` with the micro-batches a token budget (``model.data.max_tokens_per_micro_batch``,
    ``neva.data.token_budget``) fills with samples of ``seq`` tokens: as many as fit (one at least), at most a rank's
    share of the global batch; the global batch stays."""
    layout = dep.layout
    share = max(1, layout.global_batch_size // layout.dp)
    micro = max(1, min(share, budget // max(1, seq)))
    return dataclasses.replace(dep, layout=dataclasses.replace(layout, micro_batch_size=micro))


def packed_rows(seq: int, micro: int, row: int, multiple: int) -> tuple[int, int]:
    """(rows, tokens per row) of a packed micro-batch of ``micro`` samples of ``seq`` tokens, as ``collate_packed``
    lays them out: first-fit into rows of at most ``row`` tokens (equal samples: as many per row as fit, one at least),
    every row as long as the fullest rounded up to ``multiple`` (capped at ``row``)."""
    per_row = max(1, row // max(1, seq))
    fullest = min(micro, per_row) * seq
    return -(-micro // per_row), min(-(-fullest // multiple) * multiple, row)


def plan_run(
    cfg: TrainConfig,
    text_tokens: int | None = None,
    global_batch_size: int | None = None,
    grad_reduce: str | None = None,
    model: NevaConfig | None = None,
    num_frames: int | None = None,
    image_size: tuple[int, int] | None = None,
    image_tokens: float | str | None = None,
    max_pixels: int | None = None,
) -> Plan:
    """Predict memory and throughput of ``cfg`` without allocating the model.

    Args:
        cfg: a composed, validated config (``neva.config.compose_config``).
        text_tokens: mean text tokens per sample (default: ``text_tokens_of(cfg)``).
        global_batch_size: overrides ``cfg.model.global_batch_size`` (weak-scaling sweeps).
        grad_reduce: gradient-reduction dtype, ``fp32`` or ``bf16`` (see ``Deployment``).
        model: the architecture, when it is not the one ``cfg.model.mm_cfg`` names (the benchmark's own shapes).
        num_frames: each sample holds one video of this many frames instead of one image (``plan.num_frames``):
            frames × tower passes, ``NevaConfig.video_tokens(num_frames)`` positions.
        image_size: an AnyRes model's typical image ``(height, width)`` (``neva.planner.images``; None: the
            worst case).
        image_tokens: an AnyRes model's mean positions per image, or ``"data"``: measured from
            ``cfg.model.data`` (``neva.planner.images.image_load``).
        max_pixels: a native-resolution tower's pixel budget per image (``plan.max_pixels``; None: the data's
            ``model.data.max_pixels``, else the tower kind's): the image planned is the largest it lets through.

    Raises:
        ConfigError: a run training refuses: the layout's own validation (``deployment_from_config``) and every
            start-time rule training asks (``neva.parallel.run_rules.check_run``: O2 with DDP, TP sizes that do not
            divide the model, LoRA or a trained tower under TP, pipeline chunks without a layer, an EP size that
            does not divide the experts, context parallelism with what it does not compose with yet, the stage's
            refused settings, ...), with training's message.
    """
    ncfg = model or neva_config_from_mm(cfg.model.mm_cfg, image_aspect_ratio=cfg.model.data.image_aspect_ratio)
    dep = deployment_from_config(cfg, global_batch_size, grad_reduce)
    layout = dep.layout
    # The model sees sequences: a preference pair is two (its micro-batches counted in them); dep stays in samples.
    rows = sequences_per_sample(cfg)
    seq_dep = sequence_deployment(dep, rows) if rows > 1 else dep
    reference = cfg.reference_kind()
    policy = cfg.model.trainable_policy()
    # training's own start-time rules and messages (fp16, which training refuses, is planned by its O2 flag)
    check_run(cfg, layout, meta_model(ncfg, policy), Precision(master_weights=dep.precision == "o2"))
    hw = hardware_from_config(cfg.cluster)
    infos = model_inventory(ncfg, policy)
    layers = stage_layers(ncfg.llm.num_layers, layout)
    frames = num_frames or 0
    if frames and ncfg.video is None:
        raise ConfigError("plan.num_frames needs a video model (model.mm_cfg.mm_spatial_pool_stride)")
    images = image_load(ncfg, image_size, image_tokens, cfg.model.data, max_pixels)
    seq = sample_tokens(cfg, ncfg.video_tokens(frames) if frames else images.tokens, text_tokens)
    if cfg.model.data.max_tokens_per_micro_batch is not None:  # micro-batches of as many planned samples as fit
        dep = budget_deployment(dep, seq, cfg.model.data.max_tokens_per_micro_batch)
        seq_dep, layout = dep, dep.layout
    packing = None
    if cfg.model.data.packing:  # the model computes whole rows: a sample's share of its micro-batch's rows
        micro, row = seq_dep.layout.micro_batch_size, cfg.model.data.seq_length or ncfg.llm.max_seq_len
        n_rows, row_tokens = packed_rows(seq, micro, row, max(1, cfg.model.data.pad_to_multiple_of))
        packing = {"mean_sample": seq, "rows": n_rows, "row_tokens": row_tokens, "row_limit": row}
        seq = -(-n_rows * row_tokens // micro)
    learned = (text_tokens_of(cfg) if text_tokens is None else text_tokens) * learned_fraction_of(cfg)
    flops = stage_flops(infos, ncfg, layout, seq, layers, images.tiles, frames, images.grid)
    if reference is not None:  # its forward of each sequence, without autograd
        ref = stage_flops(frozen_inventory(infos), ncfg, layout, seq, layers, images.tiles, frames, images.grid)
        flops = [StageFlops(f.model + r.model, f.per_gpu + r.per_gpu, f.backward) for f, r in zip(flops, ref)]
    stages, bus = [], []
    for s in range(layout.pp):
        whole = rank_state_bytes(infos, dep, s, layers)
        state, host_state = state_offload(whole, dep)
        acts, host_acts = stage_activation_split(
            ncfg,
            infos,
            seq_dep,
            seq,
            s,
            layers[s],
            flops[s].backward,
            in_flight_microbatches(layout, s),
            learned,
            images.tiles,
            frames,
        )
        working = working_bytes(infos, seq_dep, s, layers)
        # bus bytes per step: FSDP2's shards and gradient shards, and every saved activation down and back up
        bus.append(
            state_bus_bytes(whole, seq_dep)
            + 2 * host_acts * layout.grad_accum / max(1.0, in_flight_microbatches(layout, s))
        )
        stages.append(
            StageMemory(
                stage=s,
                layers=len(layers[s]),
                params=state.params,
                grads=peak_grad_bytes(infos, seq_dep, s, layers, state.grads, acts + working),
                optimizer=state.optimizer,
                activations=acts,
                working=working,
                overhead=hw.eff.memory_overhead_gb * GiB,
                reference=reference_bytes(infos, dep, s, layers) if reference == "frozen" else 0,
                host=host_state + host_acts,
                rollout=rollout_cache_bytes(cfg, ncfg, layout, seq, len(layers[s]), dep.compute_bytes),
            )
        )
    time = step_time(ncfg, infos, seq_dep, hw, seq, layers, flops, bus)
    per_sample = sum(f.model for f in flops) * rows
    samples = layout.global_batch_size / time.step
    mfu = per_sample * samples / (layout.world * hw.peak_flops)
    # The dispatched hidden states are the feed-forward norm's output: fp32 under autocast, the parameters' dtype else.
    moe = moe_facts(ncfg, infos, layout, layers, seq, dispatch_bytes(dep.precision))
    extra = {"image": images.to_dict()}
    if packing is not None:
        extra["packing"] = packing
    if moe is not None:
        extra["moe"] = moe
    return Plan(dep, seq, hw.gpu_memory_gb, stages, time, per_sample, samples, mfu, extra)
