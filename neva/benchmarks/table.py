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

from neva.benchmarks import (
    ai2d,
    chartqa,
    docvqa,
    gqa,
    hallusionbench,
    mathvista,
    mmbench,
    mme,
    mmmu,
    mmstar,
    ocrbench,
    pope,
    realworldqa,
    scienceqa,
    seed,
    submission,
    textvqa,
    videomme,
)
from neva.benchmarks.files import Question, Read

Scorer = Callable[[Path, list[tuple[Question, dict | None]], Path], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Benchmark:
    folder: str  # under playground/data/eval/ (the --data-dir)
    layout: str  # the files it reads, for the error that names a missing one
    read: Callable[[Path], Read]
    score: Scorer
    max_new_tokens: int
    source: str  # LLaVA's script that runs it (lmms-eval's task file for the Hugging Face snapshots)
    unit: str  # of its top-level scores as its reference scorer computes them: UNITS
    unit_of: tuple[tuple[str, str], ...] = ()  # (score, unit) where one differs from ``unit``

    def units(self, scores: dict[str, Any]) -> dict[str, str]:
        """The unit of each top-level score in ``scores`` (``scores.json``'s ``units``)."""
        named = dict(self.unit_of)
        return {key: named.get(key, self.unit) for key, value in scores.items()
                if is_score(key, value)}  # fmt: skip


UNITS = {
    "percent": "0-100, as the paper's tables print it",
    "fraction": "0-1 (lmms-eval's and the official script's value; papers print it x100)",
    "points": "a sum of per-subtask points (MME: acc + acc+ per subtask, 0-200 each)",
    "points of 1000": "questions right out of OCRBench's 1000",
    "chi-square / 100": "GQA's distribution score, lower is better",
}
"""What a benchmark's ``unit`` means; ``neva.evaluate``'s table prints fractions as percentages, as papers do."""

BOOKKEEPING = ("n", "questions", "skipped", "questions_per_s", "max_new_tokens", "correct", "text_recognition",
               "unmatched", "unparsed", "answered", "count", "image_count", "consistency_missing_entailed")  # fmt: skip
"""Top-level numbers of a result that count questions or time, not a score."""


def is_score(key: str, value: Any) -> bool:
    """A top-level score of a result: a number that is neither bookkeeping nor a standard error."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and key not in BOOKKEEPING
            and not key.endswith(("_stderr", "_stderr_clustered")))  # fmt: skip


LOADER = 128  # model_vqa_loader.py's --max_new_tokens default; the v1_5 scripts keep it
ALL = 1024  # fixed in model_vqa_science.py and model_vqa_mmbench.py

BENCHMARKS: dict[str, Benchmark] = {
    "pope": Benchmark("pope", "llava_pope_test.jsonl, coco/coco_pope_{adversarial,popular,random}.json, val2014/",
                      pope.read, pope.score, LOADER, "scripts/v1_5/eval/pope.sh", "fraction"),
    "textvqa": Benchmark("textvqa", "llava_textvqa_val_v051_ocr.jsonl, TextVQA_0.5.1_val.json, train_images/",
                         textvqa.read, textvqa.score, LOADER, "scripts/v1_5/eval/textvqa.sh", "percent"),
    "scienceqa": Benchmark("scienceqa", "llava_test_CQM-A.json, problems.json, pid_splits.json, images/test/",
                           scienceqa.read, scienceqa.score, ALL, "scripts/v1_5/eval/sqa.sh", "percent"),
    "mme": Benchmark("MME", "llava_mme.jsonl, MME_Benchmark_release_version/<category>/",
                     mme.read, mme.score, LOADER, "scripts/v1_5/eval/mme.sh", "points"),
    "mmbench": Benchmark("mmbench", f"{mmbench.DEV_FILE} (images inline)",
                         mmbench.read, mmbench.score, ALL, "scripts/v1_5/eval/mmbench.sh", "fraction"),
    "mmbench_test": Benchmark("mmbench", f"{mmbench.TEST_FILE} (images inline)", mmbench.read_test,
                              mmbench.score_test, ALL, "scripts/v1_5/eval/mmbench.sh (SPLIT=mmbench_test_20230712), "
                              "scripts/convert_mmbench_for_submission.py", "fraction"),
    "gqa": Benchmark("gqa", "llava_gqa_testdev_balanced.jsonl, data/testdev_balanced_questions.json, data/images/",
                     gqa.read, gqa.score, LOADER, "scripts/v1_5/eval/gqa.sh", "percent",
                     (("distribution", "chi-square / 100"),)),
    "seed": Benchmark("seed_bench", "llava-seed-bench.jsonl, SEED-Bench.json, SEED-Bench-image/, "
                      "SEED-Bench-video-image/", seed.read, seed.score, LOADER, "scripts/v1_5/eval/seed.sh", "percent"),
    "vqav2": Benchmark("vqav2", "llava_vqav2_mscoco_test-dev2015.jsonl, llava_vqav2_mscoco_test2015.jsonl, test2015/",
                       submission.read_vqav2, submission.score_vqav2, LOADER, "scripts/v1_5/eval/vqav2.sh", "fraction"),
    "vizwiz": Benchmark("vizwiz", "llava_test.jsonl, test/",
                        submission.read_vizwiz, submission.score_vizwiz, LOADER, "scripts/v1_5/eval/vizwiz.sh", "fraction"),
}  # fmt: skip

# The benchmarks of current model cards, from their Hugging Face dataset snapshots (parquet), asked and scored as
# lmms-eval 0.7.3 asks and scores them: prompts and max_new_tokens from each task's YAML (``default`` kwargs), the
# scorer one file each. The folder is the dataset repository's name (--data-dir holding the snapshots), or --data-dir
# is the snapshot itself.
LMMS = "lmms-eval 0.7.3 lmms_eval/tasks/"
BENCHMARKS.update({
    "mmmu": Benchmark("MMMU", "validation-*.parquet (a folder per subject, or one)",
                      mmmu.read, mmmu.score, 128, LMMS + "mmmu/mmmu_val.yaml", "fraction"),
    "mmstar": Benchmark("MMStar", "mmstar.parquet", mmstar.read, mmstar.score, 1024, LMMS + "mmstar/mmstar.yaml", "fraction"),
    "ai2d": Benchmark("ai2d", "test-*.parquet (lmms-lab/ai2d: labels masked)",
                      ai2d.read, ai2d.score, 16, LMMS + "ai2d/ai2d.yaml", "fraction"),
    "ai2d_no_mask": Benchmark("ai2d-no-mask", "test-*.parquet (Efficient-Large-Model/ai2d-no-mask)",
                              ai2d.read, ai2d.score, 16, LMMS + "ai2d/ai2d_no_mask.yaml", "fraction"),
    "ocrbench": Benchmark("OCRBench", "test-*.parquet", ocrbench.read, ocrbench.score, 128,
                          LMMS + "ocrbench/ocrbench.yaml", "fraction",
                          (("final_score", "points of 1000"),)),
    "docvqa": Benchmark("DocVQA", "DocVQA/validation-*.parquet", docvqa.reader("DocVQA", "validation"),
                        docvqa.score, 32, LMMS + "docvqa/docvqa_val.yaml", "fraction"),
    "docvqa_test": Benchmark("DocVQA", "DocVQA/test-*.parquet", docvqa.reader("DocVQA", "test"),
                             docvqa.uploader("docvqa_test"), 32, LMMS + "docvqa/docvqa_test.yaml", "fraction"),
    "infovqa": Benchmark("DocVQA", "InfographicVQA/validation-*.parquet", docvqa.reader("InfographicVQA", "validation"),
                         docvqa.score, 32, LMMS + "infovqa/infovqa_val.yaml", "fraction"),
    "infovqa_test": Benchmark("DocVQA", "InfographicVQA/test-*.parquet", docvqa.reader("InfographicVQA", "test"),
                              docvqa.uploader("infovqa_test"), 32, LMMS + "infovqa/infovqa_test.yaml", "fraction"),
    "chartqa": Benchmark("ChartQA", "test-*.parquet", chartqa.read, chartqa.score, 16, LMMS + "chartqa/chartqa.yaml", "fraction"),
    "realworldqa": Benchmark("RealWorldQA", "test-*.parquet", realworldqa.read, realworldqa.score, 16,
                             LMMS + "realworldqa/realworldqa.yaml", "fraction"),
    "hallusionbench": Benchmark("HallusionBench", "image-*.parquet", hallusionbench.read, hallusionbench.score, 128,
                                LMMS + "hallusion_bench/hallusion_bench_image.yaml", "fraction"),
    "videomme": Benchmark("videomme", "test-*.parquet, data/<videoID>.mp4 (lmms-eval's videomme/ cache folder)",
                          videomme.reader(False), videomme.score, 16, LMMS + "videomme/videomme.yaml", "percent"),
    "videomme_w_subtitle": Benchmark("videomme", "test-*.parquet, data/<videoID>.mp4, subtitle/<videoID>.srt",
                                     videomme.reader(True), videomme.score, 16,
                                     LMMS + "videomme/videomme_w_subtitle.yaml", "percent"),
    "mathvista": Benchmark("MathVista", "testmini-*.parquet", mathvista.read, mathvista.score, 16384,
                           LMMS + "mathvista/mathvista_testmini_format.yaml", "percent"),
})  # fmt: skip
