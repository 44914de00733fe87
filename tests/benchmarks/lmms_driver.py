"""Run inside the lmms-eval side environment (``tests/benchmarks/lmms_reference.py``): lmms-eval 0.7.3's own prompt
and scoring functions on the docs and answers of ``sys.argv[1]`` (JSON: benchmark → {docs, answers}); their prompts
and scores written to ``sys.argv[2]``. Prompt kwargs come from the task YAMLs themselves (``default``)."""

import ast
import contextlib
import copy
import io
import json
import random
import sys
import types
from pathlib import Path

import yaml
from lmms_eval.api.metrics import anls, exact_match_hf_evaluate, mean_stderr

TASKS = Path(__import__("lmms_eval.tasks", fromlist=["_"]).__file__).parent


def kwargs(task_yaml: str) -> dict:
    """A task YAML's ``lmms_eval_specific_kwargs.default``, its ``include`` under it (lines with ``!function`` dropped,
    as lmms-eval's utils read their YAMLs)."""
    lines = [line for line in (TASKS / task_yaml).read_text().splitlines() if "!function" not in line]
    config = yaml.safe_load("\n".join(lines))
    if "lmms_eval_specific_kwargs" not in config:
        return kwargs(str(Path(task_yaml).parent / config["include"]))
    return config["lmms_eval_specific_kwargs"]["default"]


def stderr(scores):
    return mean_stderr(scores) if len(scores) > 1 else None


def mmmu(docs, answers):
    from lmms_eval.tasks.mmmu import utils

    kw = kwargs("mmmu/mmmu_val.yaml")
    random.seed(0)  # the evaluator's default --seed for Python's random
    results = [utils.mmmu_process_results(d, [a.strip()])["mmmu_acc"] for d, a in zip(docs, answers)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the per-domain and per-subject table it prints, as a dict
        accuracy = utils.mmmu_aggregate_results(results)
    table = ast.literal_eval(printed.getvalue().strip())
    return {"prompts": [utils.mmmu_doc_to_text(d, kw) for d in docs], "accuracy": accuracy, "table": table}


def mmstar(docs, answers):
    from lmms_eval.tasks.mmstar import utils

    kw = kwargs("mmstar/mmstar.yaml")
    per_metric = {}
    for d, a in zip(docs, answers):
        for metric, item in utils.mmstar_process_results(d, [a.strip()]).items():
            per_metric.setdefault(metric, []).append(item)
    scores = {m: utils.mmstar_aggregate_results(items) for m, items in per_metric.items()}
    errors = {m: stderr([i["score"] for i in items]) for m, items in per_metric.items()}
    return {"prompts": [utils.mmstar_doc_to_text(d, kw) for d in docs], "scores": scores, "stderr": errors}


def ai2d(docs, answers):
    from lmms_eval.tasks.ai2d import utils

    kw = kwargs("ai2d/ai2d.yaml")
    flt = utils.MultiChoiceRegexFilter(regex_pattern=r"([A-Z])\.", group_select=0, ignore_case=True,
                                       ignore_punctuation=True)  # fmt: skip
    filtered = flt.apply([[a] for a in answers], docs)
    scores = [float(exact_match_hf_evaluate(predictions=[f.strip()], references=[utils.ai2d_doc_to_target(d, "mcq")],
                                            ignore_case=True, ignore_punctuation=True)["exact_match"])
              for f, d in zip(filtered, docs)]  # fmt: skip
    return {"prompts": [utils.ai2d_doc_to_text(d, kw) for d in docs], "exact_match": sum(scores) / len(scores),
            "stderr": stderr(scores), "no_mask_kwargs_equal": kwargs("ai2d/ai2d_no_mask.yaml") == kw}  # fmt: skip


def ocrbench(docs, answers, out):
    from lmms_eval.tasks.ocrbench import utils

    kw = kwargs("ocrbench/ocrbench.yaml")
    results = [utils.ocrbench_process_results(d, [a.strip()])["ocrbench_accuracy"] for d, a in zip(docs, answers)]
    accuracy = utils.ocrbench_aggregate_accuracy(results, types.SimpleNamespace(output_path=str(out)))
    return {"prompts": [utils.ocrbench_doc_to_text(d, kw) for d in docs], "accuracy": accuracy,
            "categories": dict(utils.OCRBench_score), "stderr": stderr([r["score"] for r in results])}  # fmt: skip


def docvqa(docs, answers):
    from lmms_eval.tasks.docvqa import utils

    kw = kwargs("docvqa/_default_template_docvqa_yaml")
    scores = [anls(references=d["answers"], predictions=[a.strip()])["anls"] for d, a in zip(docs, answers)]
    return {"prompts": [utils.docvqa_doc_to_text(d, kw) for d in docs], "anls": sum(scores) / len(scores),
            "stderr": stderr(scores)}  # fmt: skip


def chartqa(docs, answers):
    from lmms_eval.tasks.chartqa import utils

    kw = kwargs("chartqa/chartqa.yaml")
    per_metric = {}
    for d, a in zip(docs, answers):
        for metric, value in utils.chartqa_process_results(d, [a.strip()]).items():
            per_metric.setdefault(metric, []).append(value)
    return {"prompts": [utils.chartqa_doc_to_text(d, kw) for d in docs],
            "scores": {m: sum(v) / len(v) for m, v in per_metric.items()},
            "stderr": {m: stderr(v) for m, v in per_metric.items()}}  # fmt: skip


def realworldqa(docs, answers):
    from lmms_eval.tasks.realworldqa import utils

    kw = kwargs("realworldqa/realworldqa.yaml")
    scores = [utils.realworldqa_process_results(d, [a.strip()])["exact_match"] for d, a in zip(docs, answers)]
    return {"prompts": [utils.realworldqa_doc_to_text(d, kw) for d in docs], "exact_match": sum(scores) / len(scores),
            "stderr": stderr(scores)}  # fmt: skip


def hallusionbench(docs, answers):
    from lmms_eval.tasks.hallusion_bench import evaluate_hb

    kw = kwargs("hallusion_bench/hallusion_bench_image.yaml")
    results = [evaluate_hb.hb_process_results(d, [a.strip()])["aAcc"] for d, a in zip(docs, answers)]
    scores = {name: getattr(evaluate_hb, f"hb_aggregation_result_{name}_intern")(copy.deepcopy(results))
              for name in ("aAcc", "qAcc", "fAcc")}  # fmt: skip
    return {"prompts": [evaluate_hb.hb_doc_to_text(d, kw) for d in docs], "scores": scores}


def mathvista(docs, answers, out):
    from lmms_eval.tasks.mathvista import utils
    from lmms_eval.tasks.mathvista.mathvista_evals import MathVistaEvaluator

    class JudgeOff(MathVistaEvaluator):
        """lmms-eval's evaluator whose LLM does not answer (what it gets without an API key), without the retries."""

        def get_chat_response(self, *args, **kw):
            return ""

    kw = kwargs("mathvista/mathvista_testmini_format.yaml")
    evaluator = JudgeOff()
    rows, results = [], []
    for d, a in zip(docs, answers):
        prediction = a.strip()
        extraction = evaluator.extract_answer(prediction, d, quick_extract=False)
        row = {}
        official = None if d["precision"] is None else int(d["precision"])  # MathVista's calculate_score.py
        for rule, precision in (("lmms", d["precision"]), ("official", official)):
            normalized = evaluator.normalize_extracted_answer(extraction, d["choices"], d["question_type"],
                                                              d["answer_type"], precision)  # fmt: skip
            row[rule] = evaluator.safe_equal(normalized, d["answer"])
        rows.append(row)
        results.append({"question_id": d["pid"], "true_false": row["official"], "question_type": d["question_type"],
                        "answer_type": d["answer_type"], "metadata": copy.deepcopy(d["metadata"])})  # fmt: skip
    accuracy = utils.mathvista_aggregate_results(results, types.SimpleNamespace(output_path=str(out)))
    return {"prompts": [utils.mathvista_doc_to_text(d, kw) for d in docs], "rows": rows, "accuracy": accuracy}


def videomme(docs, answers, hf_home):
    import os

    os.environ["HF_HOME"] = hf_home  # where utils looks for videomme/data and videomme/subtitle, read at its import
    from lmms_eval.api.metrics import clustered_stderr
    from lmms_eval.tasks.videomme import utils

    plain_kw, subtitle_kw = kwargs("videomme/videomme.yaml"), kwargs("videomme/videomme_w_subtitle.yaml")
    results = [utils.videomme_process_results(d, [a.strip()])["videomme_perception_score"]
               for d, a in zip(docs, answers)]  # fmt: skip
    scores = [r["score"] for r in results]
    return {"prompts": [utils.videomme_doc_to_text(d, plain_kw) for d in docs],
            "subtitle_prompts": [utils.videomme_doc_to_text_subtitle(d, subtitle_kw) for d in docs],
            "accuracy": utils.videomme_aggregate_results(results), "stderr": stderr(scores),
            "clustered": clustered_stderr(scores, [r["videoID"] for r in results])}  # fmt: skip


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2]).parent
    result = {}
    for name, case in cases.items():
        fn = globals()[name]
        extra = (out,) if name in ("ocrbench", "mathvista") else (case["hf_home"],) if name == "videomme" else ()
        result[name] = fn(case["docs"], case["answers"], *extra)
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
