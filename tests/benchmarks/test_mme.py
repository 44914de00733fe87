"""MME end to end: answers looked up in the release's question files, acc + acc+ per subtask, the two totals."""

from neva.benchmarks import mme
from neva.benchmarks.files import Question
from tests.benchmarks.conftest import ANSWER_FIELDS, draw, run_suite, write_jsonl

SHORT = "Answer the question using a single word or phrase."
# category → image → [(question, answer)]; artwork has images/ + questions_answers_YN/, count keeps both together
RELEASE = {
    "artwork": {"10002.jpg": [("Is this by Monet?", "Yes"), ("Is this by Degas?", "No")]},
    "count": {"000000006040.jpg": [("Are there two cats?", "No"), ("Are there three cats?", "Yes")],
              "000000007108.jpg": [("Is there one dog?", "Yes"), ("Are there two dogs?", "No")]},
    "code_reasoning": {"0020.png": [("Does it print 3?", "Yes"), ("Does it print 4?", "No")]},
}  # fmt: skip


def make_mme(root):
    folder = root / "MME"
    records = []
    for category, images in RELEASE.items():
        nested = category == "artwork"
        for image, qas in images.items():
            stem = image.split(".")[0]
            where = f"{category}/images/{image}" if nested else f"{category}/{image}"
            draw(folder / "MME_Benchmark_release_version" / where)
            qa_dir = folder / "MME_Benchmark_release_version" / category / ("questions_answers_YN" if nested else "")
            qa_dir.mkdir(parents=True, exist_ok=True)
            (qa_dir / f"{stem}.txt").write_text("".join(f"{q} Please answer yes or no.\t{a}\n" for q, a in qas))
            for q, _ in qas:
                text = f"{q} Please answer yes or no.\n{SHORT}"
                records.append(
                    {"question_id": f"{category}/{image}", "image": where, "text": text, "category": category}
                )
    write_jsonl(folder / "llava_mme.jsonl", records)
    return records


def expected(texts: dict[tuple[str, str, str], str]) -> dict[str, float]:
    """calculation.py's score written independently: per category 100·(right answers / answers) plus 100·(images with
    both right / images); a reply starting yes / no is that, else its first four characters decide."""

    def read(text: str) -> str:
        t = text.strip().lower()
        return "yes" if "yes" in t[:4] else "no" if "no" in t[:4] else "other"

    totals = {}
    for category, images in RELEASE.items():
        marks = {image: [read(texts[category, image, q]) == a.lower() for q, a in qas] for image, qas in images.items()}
        flat = [m for ms in marks.values() for m in ms]
        totals[category] = 100 * sum(flat) / len(flat) + 100 * sum(all(ms) for ms in marks.values()) / len(marks)
    return totals


def test_mme_answers_and_totals(tiny_checkpoint, tmp_path, capsys):
    records = make_mme(tmp_path)
    result, answers = run_suite("mme", tiny_checkpoint, tmp_path, tmp_path / "out", capsys)
    assert all(set(a) == ANSWER_FIELDS for a in answers) and result["unmatched"] == 0
    texts = {(r["category"], r["question_id"].split("/")[1], r["text"].split(" Please")[0]): a["text"]
             for r, a in zip(records, answers)}  # fmt: skip
    want = expected(texts)
    assert {c: s["score"] for c, s in result["subtasks"].items()} == want
    assert result["perception"] == want["artwork"] + want["count"] and result["cognition"] == want["code_reasoning"]


def test_mme_yes_no_reading(tmp_path):
    replies = {("count", "000000006040.jpg", "Are there two cats?"): "No, three.",
               ("count", "000000006040.jpg", "Are there three cats?"): "yes",
               ("count", "000000007108.jpg", "Is there one dog?"): "I think yes",
               ("count", "000000007108.jpg", "Are there two dogs?"): "nope"}  # fmt: skip
    make_mme(tmp_path)
    answered = [(Question(f"{c}/{i}", "", ""), {"question_id": f"{c}/{i}", "prompt": f"{q} Please answer yes or no.",
                                                 "text": t}) for (c, i, q), t in replies.items()]  # fmt: skip
    got = mme.score(tmp_path / "MME", answered, tmp_path)["subtasks"]["count"]
    # right: no, yes, other (wrong), no → 3 of 4; images with both right: the first only
    assert got["acc"] == 75.0 and got["acc_plus"] == 50.0
