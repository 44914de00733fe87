"""The headroom knobs train the same steps (issue 53), on a mixed set of video, one- and two-image and text-only
LLaVA records, against fixed micro-batches in one process (losses and gradient norms within 1e-6 relative):

- micro-batches filled to a token budget (``model.data.max_tokens_per_micro_batch``, ``neva.data.token_budget``) in
  one process, under DP2 (FSDP2), every rank running as many micro-batches, their number varying per step, and
  under PP2 (1F1B: at least one micro-batch per stage);
- FSDP2's CPU offload (``model.fsdp_offload``) with activation offload (``model.activation_offload``): over full
  recomputation under DP2, and under TP2 (FSDP2 then wraps a data-parallel group of one for the offload).
"""

from __future__ import annotations

import json

import pytest

from tests.data.video_files import write_video

from .harness import make_checkpoint, run_layouts, train_losses
from .llava_data import llava_overrides, write_llava_set

pytestmark = pytest.mark.slow

STEPS = 2
# samples of 160-470 tokens padded to 16, rows of at most 512: two short ones or one long one per micro-batch
BUDGET = ["model.data.max_tokens_per_micro_batch=768"]


def mixed_set(directory):
    """``write_llava_set``'s image and text records and a video record of 5 or 8 frames every fourth."""
    path, images = write_llava_set(directory, n=32)
    records = json.loads(path.read_text())
    for i in range(0, len(records), 4):
        name = f"clip{i}.mp4"
        write_video(images / name, frames=5 + 3 * (i % 8 == 0), size=32)
        question = records[i]["conversations"][0]["value"].replace("<image>\n", "")
        records[i]["conversations"][0]["value"] = "<video>\n" + question
        records[i].pop("image", None)
        records[i]["video"] = name
    path.write_text(json.dumps(records))
    return directory


def test_headroom_knobs_train_the_fixed_steps(tmp_path):
    small = ["++model.mm_cfg.llm.arch_overrides={num_layers:2}"]  # the smallest decoder that has a block to offload
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama_clip_video", extra=small)
    common = [
        f"model.restore_from_path={ckpt}",
        *small,
        *llava_overrides(mixed_set(tmp_path / "data"), packing=False),
        "model.data.num_frames=4",
    ]
    args = {"steps": STEPS, "from_data": True}
    ref = train_losses(common, **args)
    one = train_losses(common + BUDGET, keep_engine=True, **args)
    dataset = one.pop("data").train_datasets[0]
    # the budget's lengths are the samples' own (a video counted at num_frames: these have at least 4)
    assert dataset.token_lengths() == [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
    offload = ["model.fsdp_offload=true", "model.activation_offload=true",
               "model.activations_checkpoint_granularity=full"]  # fmt: skip
    tp2 = ["model.tensor_model_parallel_size=2", "model.fsdp_offload=true", "model.activation_offload=true"]
    jobs = [
        ("dp2_budget", common + BUDGET, args),
        ("dp2_offload", common + offload, args),
        ("tp2_offload", common + tp2, args),
        ("pp2_budget", common + BUDGET + ["model.pipeline_model_parallel_size=2"], args),
    ]
    results = run_layouts(2, jobs, tmp_path / "runs")
    print("micro-batches per step (fixed, budget, dp2 budget):", ref["micro_batches"], one["micro_batches"],
          [r["dp2_budget"]["micro_batches"] for r in results])  # fmt: skip
    assert ref["micro_batches"] == [4] * STEPS and one["micro_batches"] != ref["micro_batches"]
    for rank in results:
        assert rank["dp2_budget"]["micro_batches"] == results[0]["dp2_budget"]["micro_batches"]
        assert min(rank["pp2_budget"]["micro_batches"]) >= 2  # a 1F1B pipeline: one micro-batch per stage at least
    runs = [("one_budget", one)] + [
        (n, rank[n]) for rank in results for n in ("dp2_budget", "dp2_offload", "tp2_offload", "pp2_budget")
    ]
    for name, got in runs:
        for key in ("losses", "grad_norms"):
            err = max(abs(a - b) / abs(b) for a, b in zip(got[key], ref[key]))
            print(name, key, f"{err:.2e}")
            assert err <= 1e-6, (name, key, got[key], ref[key])
