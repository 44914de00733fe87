"""metrics.csv's FLOPs and MFU are the benchmark's: the benchmark's count for each step's samples (reproduced from the
data module, uncollated), divided by the row's step time and the configured peak, gives the row's MFU."""

import csv
import importlib
import sys
from pathlib import Path

import pytest

from neva.checkpoint.source import resolve_source
from neva.data.datamodule import NevaDataModule
from neva.models.flops import SampleFlops
from neva.models.trainable import build_meta_model
from neva.training.run import run

PEAK = 0.002  # TFLOP/s: any configured peak makes the CPU run write MFU


def bench_step_flops():
    """``scripts/bench/build.py``'s ``step_flops`` (scripts/ is not a package: the benchmark puts it on the path)."""
    scripts = str(Path(__file__).resolve().parents[2] / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return importlib.import_module("bench.build").step_flops


def step_samples(cfg, source, steps: int, accum: int) -> list[list[dict]]:
    """The raw samples of each of the first ``steps`` optimizer steps, in the training run's order."""
    data = NevaDataModule(
        cfg.model.data,
        source.tokenizer,
        source.cfg,
        micro_batch_size=cfg.model.micro_batch_size,
        seed=cfg.model.seed,
        accumulation=accum,
    )
    data.train_dataloader()  # builds the sampler
    (dataset,) = data.train_datasets
    micro = [[dataset[i] for i in indices] for indices in data.train_sampler][: steps * accum]
    return [[s for mb in micro[k * accum : (k + 1) * accum] for s in mb] for k in range(steps)]


# Pretraining on packed rows; the LLM trained too (finetune's policy and template) on padded rows.
CASES = {
    "pretrain_packed": ["model.data.packing=true"],
    "llm_trained_padded": [
        "model.data.packing=false",
        "model.mm_cfg.llm.freeze=false",
        "model.data.conv_template=vicuna_v1",
    ],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_metrics_mfu_is_the_benchmarks(lean_cfg, case):
    steps, accum = 3, 2
    cfg = lean_cfg(
        f"trainer.max_steps={steps}",
        "trainer.log_every_n_steps=1",
        "trainer.accelerator=cpu",
        f"cluster.peak_tflops_bf16={PEAK}",
        "model.micro_batch_size=4",
        f"model.global_batch_size={4 * accum}",
        *CASES[case],
    )
    run(cfg)
    with open(Path(cfg.exp_manager.exp_dir) / "metrics.csv") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f) if r.get("train_loss")}
    assert sorted(rows) == list(range(1, steps + 1))

    source = resolve_source(cfg)
    model_flops = SampleFlops.of(build_meta_model(source.cfg, cfg.model.trainable_policy()))
    step_flops = bench_step_flops()
    for k, samples in enumerate(step_samples(cfg, source, steps, accum), start=1):
        row = rows[k]
        flops = step_flops(model_flops, samples)
        assert flops > 0
        assert float(row["flops"]) == pytest.approx(flops, rel=1e-12)
        seconds = float(row["step_time"])
        assert float(row["tflops_per_sec_per_device"]) == pytest.approx(flops / seconds / 1e12, rel=1e-6)
        assert float(row["mfu"]) == pytest.approx(flops / seconds / 1e12 / PEAK, rel=1e-6)
