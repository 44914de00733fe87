"""NVIDIA's published NeVA throughput (13B, CLIP ViT-L/14 224 px, TP 8) and the planner's predictions for it.

The published table (REFERENCES.md) is whole-cluster samples/s at 1, 2, 4, 8 and 16 DGX nodes. Samples/s grows
almost linearly, so NVIDIA kept the work per GPU constant (weak scaling): pretrain GBS 128 at 2 nodes with MBS 32
(2 micro-batches of 32 per data-parallel replica), finetune GBS 32 at 4 nodes with MBS 4 (2 micro-batches of 4).
NeMo ran Megatron's distributed optimizer (sharded fp32 master + Adam, one gradient reduce-scatter and one parameter
all-gather per step, both overlapped): in neva's terms FSDP with ZeRO-2.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from neva.config import compose_config
from neva.planner.plan import Plan, plan_run

NODES = (1, 2, 4, 8, 16)

# samples/s of the whole cluster; speedups as NVIDIA printed them (from unrounded throughput).
PUBLISHED_SAMPLES = {
    ("pretrain", "dgx_a100"): (37, 74, 145, 285, 554),
    ("pretrain", "dgx_h100"): (79, 157, 302, 569, 1124),
    ("finetune", "dgx_a100"): (12, 23, 45, 88, 172),
    ("finetune", "dgx_h100"): (24, 43, 86, 164, 316),
}
PUBLISHED_SPEEDUP = {
    ("pretrain", "dgx_a100"): (1.0, 1.99, 3.87, 7.63, 14.82),
    ("pretrain", "dgx_h100"): (1.0, 1.99, 3.83, 7.21, 14.26),
    ("finetune", "dgx_a100"): (1.0, 1.88, 3.68, 7.11, 13.94),
    ("finetune", "dgx_h100"): (1.0, 1.83, 3.66, 6.96, 13.41),
}
# (micro-batch size, micro-batches per data-parallel replica per step)
NVIDIA_BATCH = {"pretrain": (32, 2), "finetune": (4, 2)}
# Megatron-core reduces bf16 gradients unless told otherwise (grad_reduce_in_fp32=False); see docs/PLANNER.md.
NVIDIA_GRAD_REDUCE = "bf16"


def nvidia_overrides(stage: str, cluster: str) -> list[str]:
    """The Hydra overrides of NVIDIA's measured layout: 13B, 224 px, TP 8 on 8-GPU nodes, bf16 O2, no SP/AC."""
    mbs, _ = NVIDIA_BATCH[stage]
    return [
        f"+stage={stage}",
        "model=llama2_13b",
        "vision=clip_vit_l14_224",
        f"cluster={cluster}",
        "trainer.devices=8",
        "trainer.precision=bf16",
        "model.megatron_amp_O2=true",
        "model.tensor_model_parallel_size=8",
        "model.sequence_parallel=false",
        "model.data_parallel=fsdp",
        "model.zero_stage=2",
        f"model.micro_batch_size={mbs}",
    ]


@dataclass(frozen=True)
class CalibrationRow:
    """Predicted vs published numbers of one (stage, cluster, nodes) point."""

    stage: str
    cluster: str
    nodes: int
    predicted_samples_per_s: float
    published_samples_per_s: float
    predicted_speedup: float
    published_speedup: float

    @property
    def speedup_error(self) -> float:
        return self.predicted_speedup / self.published_speedup - 1


def predict(stage: str, cluster: str) -> list[Plan]:
    """The planner's predictions for NVIDIA's layout at 1..16 nodes (weak scaling)."""
    mbs, micro = NVIDIA_BATCH[stage]
    base = compose_config(nvidia_overrides(stage, cluster))
    plans = []
    for n in NODES:
        cfg = copy.deepcopy(base)
        cfg.trainer.num_nodes = n
        plans.append(plan_run(cfg, global_batch_size=mbs * micro * n, grad_reduce=NVIDIA_GRAD_REDUCE))
    return plans


def calibration_table() -> list[CalibrationRow]:
    """Every published point next to its prediction."""
    rows = []
    for (stage, cluster), published in PUBLISHED_SAMPLES.items():
        plans = predict(stage, cluster)
        one = plans[0].samples_per_s
        for n, plan, sps, speedup in zip(NODES, plans, published, PUBLISHED_SPEEDUP[(stage, cluster)]):
            rows.append(CalibrationRow(stage, cluster, n, plan.samples_per_s, sps, plan.samples_per_s / one, speedup))
    return rows


def format_table(rows: list[CalibrationRow]) -> str:
    """Markdown error table: speedups and H100/A100 throughput ratios, predicted vs published."""
    out = [
        "| stage | cluster | nodes | samples/s pred | samples/s NVIDIA | speedup pred | speedup NVIDIA | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.stage} | {r.cluster} | {r.nodes} | {r.predicted_samples_per_s:.1f} | {r.published_samples_per_s} "
            f"| {r.predicted_speedup:.2f} | {r.published_speedup:.2f} | {100 * r.speedup_error:+.1f}% |"
        )
    out += ["", "| stage | nodes | H100/A100 pred | H100/A100 NVIDIA | error |", "|---|---|---|---|---|"]
    for stage, n, pred, pub in h100_ratios(rows):
        out.append(f"| {stage} | {n} | {pred:.2f} | {pub:.2f} | {100 * (pred / pub - 1):+.1f}% |")
    return "\n".join(out)


def h100_ratios(rows: list[CalibrationRow]) -> list[tuple[str, int, float, float]]:
    """(stage, nodes, predicted H100/A100 samples/s, published ratio)."""
    index = {(r.stage, r.cluster, r.nodes): r for r in rows}
    out = []
    for stage in ("pretrain", "finetune"):
        for n in NODES:
            a, h = index[(stage, "dgx_a100", n)], index[(stage, "dgx_h100", n)]
            pred = h.predicted_samples_per_s / a.predicted_samples_per_s
            out.append((stage, n, pred, h.published_samples_per_s / a.published_samples_per_s))
    return out


if __name__ == "__main__":
    print(format_table(calibration_table()))
