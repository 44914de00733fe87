"""The benchmarks scored as lmms-eval 0.7.3 scores them: per benchmark, a few questions written in the dataset's own
Hugging Face layout (parquet, images embedded as PNG bytes), read by neva's reader; the prompts it asks equal
lmms-eval's ``doc_to_text`` (kwargs from the task YAML), and crafted answers that exercise each parsing and
normalisation rule score as lmms-eval's own functions score them (``lmms_driver.py``, one subprocess for all)."""

from __future__ import annotations

import pytest

from neva.benchmarks import (
    ai2d,
    chartqa,
    docvqa,
    hallusionbench,
    mathvista,
    mmmu,
    mmstar,
    ocrbench,
    realworldqa,
    videomme,
)
from tests.benchmarks.lmms_cases import CASES, videomme_case, write_parquet, write_videomme
from tests.benchmarks.lmms_reference import lmms_eval_results


def plain(docs: list[dict]) -> list[dict]:
    """The docs lmms-eval gets, without their image columns (its scorers do not read them)."""
    return [{k: v for k, v in d.items() if k not in ("image", "image_1", "image_2", "decoded_image")} for d in docs]


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """A Hugging Face home holding Video-MME as lmms-eval unpacks it."""
    home = tmp_path_factory.mktemp("hf_home")
    write_videomme(home)
    return home


@pytest.fixture(scope="module")
def lmms(tmp_path_factory, hf_home):
    cases = {name: dict(zip(("docs", "answers"), make())) for name, make in CASES.items()}
    cases = {n: {"docs": plain(c["docs"]), "answers": c["answers"]} for n, c in cases.items()}
    cases["videomme"]["hf_home"] = str(hf_home)
    return lmms_eval_results(cases, tmp_path_factory.mktemp("lmms"))


def read_back(module, folder, split_file: str, name: str, images=("image",)):
    """The case written as the dataset ships it, read by neva's reader: (questions, answers, lmms-eval's result)."""
    docs, answers = CASES[name]()
    write_parquet(folder / split_file, docs, images)
    read = module(folder) if callable(module) else module.read(folder)
    assert read.skipped == 0 and len(read.questions) == len(docs)
    for q in read.questions:  # every image decodes
        assert all(i.open().size == (16, 12) for i in q.images)
    return read.questions, answers


def pairs(questions, answers):
    return [(q.meta, a.strip()) for q, a in zip(questions, answers)]


def test_mmmu(lmms, tmp_path):
    questions, answers = read_back(mmmu, tmp_path, "Art/validation-00000-of-00001.parquet", "mmmu",
                                   ("image_1", "image_2"))  # fmt: skip
    ref = lmms["mmmu"]
    assert [q.text for q in questions] == ref["prompts"]
    assert [len(q.images) for q in questions][:2] == [2, 1]  # <image 2> named in the first question only
    got = mmmu.score_answers(pairs(questions, answers))
    assert got["accuracy"] == ref["accuracy"] == ref["table"]["Overall"]["acc"]
    # lmms-eval's printed table: every domain (an empty one at 0) and every subject answered
    table = {f"Overall-{d}": v for d, v in got["domains"].items()} | got["subjects"]
    assert table == {k: v for k, v in ref["table"].items() if k != "Overall"}


def test_mmstar(lmms, tmp_path):
    questions, answers = read_back(mmstar, tmp_path, "mmstar.parquet", "mmstar")
    ref = lmms["mmstar"]
    assert [q.text for q in questions] == ref["prompts"]
    got = mmstar.score_answers(pairs(questions, answers))
    assert {m: got[m] for m in ref["scores"]} == ref["scores"]
    assert {m: got[f"{m}_stderr"] for m in ref["stderr"]} == pytest.approx(ref["stderr"], rel=1e-12)


def test_ai2d(lmms, tmp_path):
    questions, answers = read_back(ai2d, tmp_path, "data/test-00000-of-00001.parquet", "ai2d")
    ref = lmms["ai2d"]
    assert [q.text for q in questions] == ref["prompts"] and ref["no_mask_kwargs_equal"]
    got = ai2d.score_answers(pairs(questions, answers))
    assert got["exact_match"] == ref["exact_match"]
    assert got["exact_match_stderr"] == pytest.approx(ref["stderr"], rel=1e-12)


def test_ocrbench(lmms, tmp_path):
    questions, answers = read_back(ocrbench, tmp_path, "data/test-00000-of-00001.parquet", "ocrbench")
    ref = lmms["ocrbench"]
    assert [q.text for q in questions] == ref["prompts"]
    got = ocrbench.score_answers(pairs(questions, answers))
    assert got["accuracy"] == ref["accuracy"] and got["categories"] == ref["categories"]
    assert got["accuracy_stderr"] == pytest.approx(ref["stderr"], rel=1e-12)


def test_docvqa_and_infovqa(lmms, tmp_path):
    ref = lmms["docvqa"]
    for subset, name in (("DocVQA", "docvqa"), ("InfographicVQA", "infovqa")):
        folder = tmp_path / "DocVQA"  # the snapshot of lmms-lab/DocVQA: one folder per config
        reader = docvqa.reader(subset, "validation")
        questions, answers = read_back(reader, folder, f"{subset}/validation-00000-of-00001.parquet", "docvqa")
        assert [q.text for q in questions] == ref["prompts"], name
        got = docvqa.score_answers(pairs(questions, answers))
        assert got["anls"] == ref["anls"]
        assert got["anls_stderr"] == pytest.approx(ref["stderr"], rel=1e-12)
        assert [q.text for q in docvqa.reader(subset, "validation")(folder / subset).questions] == ref["prompts"]


def test_chartqa(lmms, tmp_path):
    questions, answers = read_back(chartqa, tmp_path, "data/test-00000-of-00001.parquet", "chartqa")
    ref = lmms["chartqa"]
    assert [q.text for q in questions] == ref["prompts"]
    got = chartqa.score_answers(pairs(questions, answers))
    assert {m: got[m] for m in ref["scores"]} == ref["scores"]
    assert {m: got[f"{m}_stderr"] for m in ref["stderr"]} == pytest.approx(ref["stderr"], rel=1e-12)


def test_realworldqa(lmms, tmp_path):
    questions, answers = read_back(realworldqa, tmp_path, "data/test-00000-of-00001.parquet", "realworldqa")
    ref = lmms["realworldqa"]
    assert [q.text for q in questions] == ref["prompts"]
    got = realworldqa.score_answers(pairs(questions, answers))
    assert got["exact_match"] == ref["exact_match"]
    assert got["exact_match_stderr"] == pytest.approx(ref["stderr"], rel=1e-12)


def test_hallusionbench(lmms, tmp_path):
    questions, answers = read_back(hallusionbench, tmp_path, "data/image-00000-of-00001.parquet", "hallusionbench")
    ref = lmms["hallusionbench"]
    assert [q.text for q in questions] == ref["prompts"]
    got = hallusionbench.score_answers(pairs(questions, answers))
    assert {m: got[m] for m in ref["scores"]} == ref["scores"]
    assert got["judge"].startswith("none")


def test_mathvista(lmms, tmp_path):
    questions, answers = read_back(mathvista, tmp_path, "data/testmini-00000-of-00001.parquet", "mathvista",
                                   ("decoded_image",))  # fmt: skip
    ref = lmms["mathvista"]
    assert [q.text for q in questions] == ref["prompts"]
    mine = [mathvista.right(q.meta, a) for q, a in zip(questions, answers)]
    # MathVista's rule (floats rounded to int(precision) decimals) question by question
    assert mine == [r["official"] for r in ref["rows"]]
    # lmms-eval 0.7.3's round(x, 1.0) raises: every float question wrong there, some right by the official rule
    floats = [i for i, q in enumerate(questions) if q.meta["answer_type"] == "float"]
    assert not any(ref["rows"][i]["lmms"] for i in floats) and any(mine[i] for i in floats)
    got = mathvista.score_answers(pairs(questions, answers))
    assert got["accuracy"] == ref["accuracy"] and got["judge"].startswith("none")
    # a plugged-in judge is asked what the rules cannot read, and only that (here it answers with the last word:
    # "(D)", "12.0" and "2.5" are then right, "2]" is not)
    asked = []

    def judge(doc, response):
        asked.append(response)
        return response.split()[-1]

    judged = mathvista.score_answers(pairs(questions, answers), judge=judge)
    assert judged["correct"] == got["correct"] + 3 and judged["judge"] == "plugged in"
    assert asked == ["(D)", "12.0", "about 2.5", "[1, 2]"]


def test_videomme(lmms, hf_home):
    ref = lmms["videomme"]
    folder = hf_home / "videomme"
    plain_read, subtitle_read = videomme.reader(False)(folder), videomme.reader(True)(folder)
    assert [q.text for q in plain_read.questions] == ref["prompts"]
    assert [q.text for q in subtitle_read.questions] == ref["subtitle_prompts"]
    assert "Hello there\nSecond line" in ref["subtitle_prompts"][0] and "No subtitles" in ref["subtitle_prompts"][2]
    video = plain_read.questions[0].videos[0]
    assert video.path == folder / "data" / "v1.mp4" and video.frames().shape == (32, 32, 32, 3)
    _, answers = videomme_case()
    got = videomme.score_answers(pairs(plain_read.questions, answers))
    assert got["accuracy"] == ref["accuracy"]
    assert got["accuracy_stderr"] == pytest.approx(100 * ref["stderr"], rel=1e-12)
    assert got["accuracy_stderr_clustered"] == pytest.approx(100 * ref["clustered"], rel=1e-12)
    assert set(got["duration"]) == {"short", "medium", "long"}
