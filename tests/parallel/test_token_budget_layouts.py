"""Micro-batches filled to a token budget (``model.data.max_tokens_per_micro_batch``) train the same steps as fixed
micro-batches: on a mixed set of video, one- and two-image and text-only LLaVA records, the same global batches give
the same losses and gradient norms (≤ 1e-6) in one process and under DP2 (FSDP2) as fixed micro-batches in one
process, every rank running as many micro-batches,
their number varying from step to step (``neva.data.token_budget``)."""

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


def test_token_budget_steps_equal_fixed_micro_batches(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama_clip_video")
    common = [
        f"model.restore_from_path={ckpt}",
        *llava_overrides(mixed_set(tmp_path / "data"), packing=False),
        "model.data.num_frames=4",
    ]
    args = {"steps": STEPS, "from_data": True}
    ref = train_losses(common, **args)
    one = train_losses(common + BUDGET, keep_engine=True, **args)
    dataset = one.pop("data").train_datasets[0]
    # the budget's lengths are the samples' own (a video counted at num_frames: these have at least 4)
    assert dataset.token_lengths() == [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
    jobs = [("dp2_budget", common + BUDGET, args)]
    results = run_layouts(2, jobs, tmp_path / "runs")
    print("micro-batches per step (fixed, budget, dp2 budget):", ref["micro_batches"], one["micro_batches"],
          [r["dp2_budget"]["micro_batches"] for r in results])  # fmt: skip
    assert ref["micro_batches"] == [4] * STEPS and one["micro_batches"] != ref["micro_batches"]
    for rank in results:
        assert rank["dp2_budget"]["micro_batches"] == results[0]["dp2_budget"]["micro_batches"]
    for name, got in [("one_budget", one)] + [("dp2_budget", rank["dp2_budget"]) for rank in results]:
        for key in ("losses", "grad_norms"):
            err = max(abs(a - b) / abs(b) for a, b in zip(got[key], ref[key]))
            print(name, key, f"{err:.2e}")
            assert err <= 1e-6, (name, key, got[key], ref[key])
