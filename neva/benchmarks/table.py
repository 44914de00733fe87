"""The benchmarks ``python -m neva.evaluate --suite NAME --data-dir DIR`` runs: one row each.

Prompts: LLaVA-1.5's question files carry their instruction (``Answer the question using a single word or phrase.``
for short answers, ``Answer with the option's letter from the given choices directly.`` for SEED's options), so
those are asked as written; ScienceQA and MMBench get the letter instruction from the script (``--single-pred-prompt``).
Decoding: greedy (``--temperature 0`` in every ``scripts/v1_5/eval/*.sh``); ``max_new_tokens``: what each script's
answering program uses (``model_vqa_loader.py``'s default 128; ``model_vqa_science.py`` and
``model_vqa_mmbench.py`` fix 1024). The model's conversation template is the checkpoint's (LLaVA's scripts pass
``--conv-mode vicuna_v1``, its models' template).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neva.benchmarks import gqa, mmbench, mme, pope, scienceqa, seed, submission, textvqa
from neva.benchmarks.files import Question, Read

Scorer = Callable[[Path, list[tuple[Question, dict | None]], Path], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Benchmark:
    folder: str  # under playground/data/eval/ (the --data-dir)
    layout: str  # the files it reads, for the error that names a missing one
    read: Callable[[Path], Read]
    score: Scorer
    max_new_tokens: int
    source: str  # LLaVA's script that runs it


LOADER = 128  # model_vqa_loader.py's --max_new_tokens default; the v1_5 scripts keep it
ALL = 1024  # fixed in model_vqa_science.py and model_vqa_mmbench.py

BENCHMARKS: dict[str, Benchmark] = {
    "pope": Benchmark("pope", "llava_pope_test.jsonl, coco/coco_pope_{adversarial,popular,random}.json, val2014/",
                      pope.read, pope.score, LOADER, "scripts/v1_5/eval/pope.sh"),
    "textvqa": Benchmark("textvqa", "llava_textvqa_val_v051_ocr.jsonl, TextVQA_0.5.1_val.json, train_images/",
                         textvqa.read, textvqa.score, LOADER, "scripts/v1_5/eval/textvqa.sh"),
    "scienceqa": Benchmark("scienceqa", "llava_test_CQM-A.json, problems.json, pid_splits.json, images/test/",
                           scienceqa.read, scienceqa.score, ALL, "scripts/v1_5/eval/sqa.sh"),
    "mme": Benchmark("MME", "llava_mme.jsonl, MME_Benchmark_release_version/<category>/",
                     mme.read, mme.score, LOADER, "scripts/v1_5/eval/mme.sh"),
    "mmbench": Benchmark("mmbench", f"{mmbench.DEV_FILE} (images inline)",
                         mmbench.read, mmbench.score, ALL, "scripts/v1_5/eval/mmbench.sh"),
    "mmbench_test": Benchmark("mmbench", f"{mmbench.TEST_FILE} (images inline)", mmbench.read_test,
                              mmbench.score_test, ALL, "scripts/v1_5/eval/mmbench.sh (SPLIT=mmbench_test_20230712), "
                              "scripts/convert_mmbench_for_submission.py"),
    "gqa": Benchmark("gqa", "llava_gqa_testdev_balanced.jsonl, data/testdev_balanced_questions.json, data/images/",
                     gqa.read, gqa.score, LOADER, "scripts/v1_5/eval/gqa.sh"),
    "seed": Benchmark("seed_bench", "llava-seed-bench.jsonl, SEED-Bench.json, SEED-Bench-image/, "
                      "SEED-Bench-video-image/", seed.read, seed.score, LOADER, "scripts/v1_5/eval/seed.sh"),
    "vqav2": Benchmark("vqav2", "llava_vqav2_mscoco_test-dev2015.jsonl, llava_vqav2_mscoco_test2015.jsonl, test2015/",
                       submission.read_vqav2, submission.score_vqav2, LOADER, "scripts/v1_5/eval/vqav2.sh"),
    "vizwiz": Benchmark("vizwiz", "llava_test.jsonl, test/",
                        submission.read_vizwiz, submission.score_vizwiz, LOADER, "scripts/v1_5/eval/vizwiz.sh"),
}  # fmt: skip
