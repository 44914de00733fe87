"""Bad input ends ``neva.evaluate --suite BENCH`` before any generation: one line naming the file and the layout, exit
status 2."""

import pytest

from tests.benchmarks.conftest import run_suite, write_jsonl
from tests.benchmarks.test_pope import make_pope


def refusal(suite, checkpoint, data_dir, out, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        run_suite(suite, checkpoint, data_dir, out, capsys)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and not (out / "answers.jsonl").exists()
    return err


def test_a_missing_file_is_named_with_the_layout(tiny_checkpoint, tmp_path, capsys):
    err = refusal("textvqa", tiny_checkpoint, tmp_path, tmp_path / "out", capsys)
    assert "llava_textvqa_val_v051_ocr.jsonl is missing" in err and "TextVQA_0.5.1_val.json" in err


def test_a_missing_scorer_file_is_refused_before_answering(tiny_checkpoint, tmp_path, capsys):
    make_pope(tmp_path)
    for labels in (tmp_path / "pope" / "coco").iterdir():
        labels.unlink()
    (tmp_path / "pope" / "coco").rmdir()
    err = refusal("pope", tiny_checkpoint, tmp_path, tmp_path / "out", capsys)
    assert "coco is missing" in err and "coco_pope_" in err


def test_absent_images_are_refused(tiny_checkpoint, tmp_path, capsys):
    make_pope(tmp_path)
    for image in (tmp_path / "pope" / "val2014").iterdir():
        image.unlink()
    err = refusal("pope", tiny_checkpoint, tmp_path, tmp_path / "out", capsys)
    assert "5 image(s) missing" in err and "val2014" in err


def test_unanswerable_records_are_counted_skips(tiny_checkpoint, tmp_path, capsys):
    questions = make_pope(tmp_path)
    bad = {"question_id": 1, "image": questions[0]["image"], "text": "<image> <image> two tags", "category": "random"}
    write_jsonl(tmp_path / "pope" / "llava_pope_test.jsonl", [*questions, {"question_id": 2}, bad])
    result, answers = run_suite("pope", tiny_checkpoint, tmp_path, tmp_path / "out", capsys)
    assert result["skipped"] == 2 and result["questions"] == 6 and len(answers) == 5


def test_training_refuses_bad_eval_suites_at_start(tmp_path):
    """``model.eval.suites`` is checked by ``neva.train`` before anything is built, with the benchmarks' own checks;
    a question past the suite's ``limit`` is not read."""
    from neva.config import compose_config
    from neva.errors import ConfigError
    from neva.training_eval import check_suites

    make_pope(tmp_path)
    (tmp_path / "pope" / "val2014" / "COCO_val2014_000000000103.jpg").unlink()  # the fourth question's image

    def check(suite: str) -> list:
        return check_suites(compose_config(["+stage=finetune", f"model.eval.suites=[{suite}]"]))

    data = f"data_dir:'{tmp_path}'"
    with pytest.raises(
        ConfigError, match=r"suites\[0\]\.name='popo': no such benchmark or suite; choose one of pope.*, skills"
    ):
        check(f"{{name:popo,{data}}}")
    with pytest.raises(ConfigError, match=r"suites\[0\]\.data_dir: not set"):
        check("{name:pope}")
    with pytest.raises(ConfigError, match=r"suites\[0\]: pope: 1 image\(s\) missing, the first .*000000000103.jpg"):
        check(f"{{name:pope,{data}}}")
    # generation under sequence parallelism runs (neva.parallel.generation_model pads each forward): the suites are
    # read as without it; its one refusal, linear-attention layers, is a start-time rule (test_run_rules.py)
    (loaded,) = check_suites(compose_config(["+stage=finetune", f"model.eval.suites=[{{name:pope,{data},limit:3}}]",
                                             "model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]))  # fmt: skip
    assert len(loaded.read.questions) == 3
    (loaded,) = check(f"{{name:pope,{data},limit:3}}")
    assert len(loaded.read.questions) == 3
