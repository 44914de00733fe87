"""The current benchmarks end to end: a tiny checkpoint answers every one of them in one ``neva.evaluate --suite
a,b,...`` run (files in the datasets' own layout), each benchmark's scores.json is its scorer on the answers written;
an HF model directory (llava-hf, Qwen2.5-VL, whose native video path answers Video-MME) scores as the neva checkpoint
converted from it."""

from __future__ import annotations

import json

import pytest
import torch

from neva.benchmarks.run import load_benchmark
from neva.benchmarks.table import BENCHMARKS
from neva.convert import main as convert_main
from neva.evaluate import main as evaluate_main
from tests.benchmarks.lmms_cases import CASES, write_snapshots
from tests.checkpoint.tiny_hf import make_llava_dir, one_thread
from tests.fixtures.tiny_qwen_vl import tiny_qwen_vl_dir

SCORED = ("mmmu", "mmstar", "ai2d", "ai2d_no_mask", "ocrbench", "docvqa", "infovqa", "chartqa", "realworldqa",
          "hallusionbench", "mathvista", "videomme", "videomme_w_subtitle")  # fmt: skip
UPLOADS = ("docvqa_test", "infovqa_test")
NOT_SCORES = (
    "suite",
    "units",
    "questions",
    "skipped",
    "questions_per_s",
    "answers_file",
    "max_new_tokens",
    "checkpoint",
)


def evaluate(args: list[str], capsys) -> str:
    try:
        with one_thread():
            evaluate_main([*args, "--max-new-tokens", "3", "--batch-size", "4"])
    finally:
        torch.set_grad_enabled(True)  # evaluate turns autograd off for its process
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("snapshots")
    write_snapshots(root)
    return root


def test_every_benchmark_in_one_run(tiny_checkpoint, data_dir, tmp_path, capsys):
    out = tmp_path / "out"
    suites = [*SCORED, *UPLOADS]
    printed = evaluate(["--suite", ",".join(suites), "--checkpoint", str(tiny_checkpoint), "--data-dir", str(data_dir),
                        "--output-dir", str(out)], capsys).splitlines()  # fmt: skip
    assert [line.split()[0] for line in printed] == suites  # one table line per benchmark, in the order asked
    everything = json.loads((out / "scores.json").read_text())
    for name, result in zip(suites, everything):
        assert json.loads((out / name / "scores.json").read_text())["suite"] == name == result["suite"]
        bench = load_benchmark(name, data_dir)
        answers = {}
        for line in (out / name / "answers.jsonl").read_text().splitlines():
            record = json.loads(line)
            answers[record["question_id"]] = record["text"]
        assert result["questions"] == len(bench.read.questions)
        if name.startswith("videomme"):  # the tiny checkpoint has no video config: every question a counted skip
            assert result["skipped"] == result["questions"] and not answers
            continue
        assert result["skipped"] == 0 and len(answers) == len(bench.read.questions), name
        assert [q.text for q in bench.read.questions] == [json.loads(x)["prompt"] for x in
                                                           (out / name / "answers.jsonl").read_text().splitlines()]  # fmt: skip
        if name in UPLOADS:
            upload = json.loads((out / name / f"{name}_upload.json").read_text())
            assert upload == [{"questionId": q.question_id, "answer": answers[q.question_id]}
                              for q in bench.read.questions]  # fmt: skip
            continue
        module = BENCHMARKS[name].score.__module__
        rescored = __import__(module, fromlist=["_"]).score_answers(
            [(q.meta, answers[q.question_id]) for q in bench.read.questions]
        )
        assert {k: v for k, v in result.items() if k not in NOT_SCORES} == rescored, name
    assert set(CASES) <= {s.removesuffix("_no_mask") for s in SCORED} | {"docvqa"}


@pytest.mark.parametrize("family", ["llava-hf", "qwen2_5_vl"])
def test_hf_directory_scores_as_its_conversion(family, data_dir, tmp_path, capsys):
    with one_thread():
        if family == "llava-hf":
            hf = tmp_path / "hf"
            make_llava_dir(hf)
        else:
            hf = tiny_qwen_vl_dir(tmp_path, "qwen2_5_vl")
        convert_main(["hf-to-neva", "--hf", str(hf), "--out", str(tmp_path / "ckpt")])
    capsys.readouterr()
    suites = ("ai2d", "chartqa", "videomme") if family == "qwen2_5_vl" else ("ai2d", "chartqa")
    results = {}
    for source in (hf, tmp_path / "ckpt"):
        out = tmp_path / f"out_{source.name}"
        evaluate(["--suite", ",".join(suites), "--checkpoint", str(source), "--data-dir", str(data_dir),
                  "--output-dir", str(out)], capsys)  # fmt: skip
        results[source.name] = [
            ([json.loads(x)["text"] for x in (out / s / "answers.jsonl").read_text().splitlines()],
             {k: v for k, v in json.loads((out / s / "scores.json").read_text()).items() if k not in NOT_SCORES})
            for s in suites
        ]  # fmt: skip
    assert results[hf.name] == results["ckpt"]
    assert all(len(texts) == len(CASES[s]()[0]) for (texts, _), s in zip(results["ckpt"], suites))


def test_missing_or_bad_files_stop_with_one_line(tiny_checkpoint, data_dir, tmp_path, capsys):
    """Before the model is loaded: a missing split file (named, with the snapshot expected), a file that is not
    parquet, a missing video, an unknown benchmark in the list."""
    import shutil

    def refused(suite: str, data) -> str:
        with pytest.raises(SystemExit) as exit_info:
            evaluate(["--suite", suite, "--checkpoint", str(tiny_checkpoint), "--data-dir", str(data),
                      "--output-dir", str(tmp_path / "out")], capsys)  # fmt: skip
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err
        return err

    missing = refused("mmmu", tmp_path / "empty")
    assert "no validation parquet file" in missing and "(its Hugging Face snapshot)" in missing
    (tmp_path / "bad" / "MMMU").mkdir(parents=True)
    (tmp_path / "bad" / "MMMU" / "validation-00000-of-00001.parquet").write_text("not parquet")
    assert "validation-00000-of-00001.parquet is not a parquet file" in refused("mmmu", tmp_path / "bad")
    shutil.copytree(data_dir / "videomme", tmp_path / "novideo" / "videomme")
    (tmp_path / "novideo" / "videomme" / "data" / "v2.mp4").unlink()
    assert "videomme: 2 video(s) missing, the first" in refused("videomme", tmp_path / "novideo")
    assert "'mmmmu': no such benchmark" in refused("ai2d,mmmmu", data_dir)
