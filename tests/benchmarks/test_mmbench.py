"""MMBench dev end to end: every question asked once per option with the options rotated, circular accuracy."""

import base64
import csv
import io

from PIL import Image

from neva.benchmarks import mmbench
from tests.benchmarks.conftest import ANSWER_FIELDS, run_suite

INSTRUCTION = "Answer with the option's letter from the given choices directly."
ROWS = [  # index, question, hint, options, answer, category
    (0, "What colour is it?", "A shape.", ["red", "green", "blue", "black"], "C", "color"),
    (1, "How many?", "nan", ["one", "two", "nan", "nan"], "A", "count"),
]


def make_mmbench(root, extra_rows=()):
    folder = root / "mmbench"
    folder.mkdir(parents=True)
    buffer = io.BytesIO()
    Image.new("RGB", (20, 20), (200, 10, 10)).save(buffer, format="PNG")
    image = base64.b64encode(buffer.getvalue()).decode()
    header = ["index", "question", "hint", "A", "B", "C", "D", "answer", "category", "source", "l2-category",
              "comment", "split", "image"]  # fmt: skip
    with open(folder / mmbench.DEV_FILE, "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(header)
        for index, question, hint, options, answer, category in ROWS:
            writer.writerow([index, question, hint, *options, answer, category, "s", "l2", "nan", "dev", image])
        for row in extra_rows:
            writer.writerow(row)


def picks(text: str, shown: list[str]) -> str | None:
    """MMBench's letter matching written independently: one standalone letter, else one option text inside."""
    words = "".join(" " if ch in ".()[],:;!*#{}" else ch for ch in text).split()
    letters = [c for c in "ABCD"[: len(shown)] if c in words]
    if len(letters) == 1:
        return letters[0]
    inside = [c for c, o in zip("ABCD", shown) if o.lower() in text.lower()]
    return inside[0] if len(inside) == 1 else None


def test_mmbench_circular(tiny_checkpoint, tmp_path, capsys):
    # a row whose inline image does not decode: each of its two rounds is a counted skip, and the question fails
    make_mmbench(tmp_path, [[7, "Q?", "nan", "a", "b", "nan", "nan", "A", "color", "s", "l2", "nan", "dev", "@@"]])
    result, answers = run_suite("mmbench", tiny_checkpoint, tmp_path, tmp_path / "out", capsys)
    assert all(set(a) == ANSWER_FIELDS | {"round_id", "options", "option_char"} for a in answers)
    assert [(a["question_id"], a["round_id"]) for a in answers] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert answers[1]["options"] == ["green", "blue", "black", "red"] and answers[1]["option_char"] == list("BCDA")
    assert answers[0]["prompt"] == "A shape.\nWhat colour is it?\nA. red\nB. green\nC. blue\nD. black"
    assert answers[5]["prompt"] == "How many?\nA. two\nB. one"
    passed = {}
    for index, *_, answer, _ in ROWS:
        rounds = [a for a in answers if a["question_id"] == index]
        # the right option's letter in each round: where its original letter sits among option_char
        passed[index] = all(picks(a["text"], a["options"]) == "ABCD"[a["option_char"].index(answer)] for a in rounds)
    assert result["circular_accuracy"] == sum(passed.values()) / 3 and result["n"] == 3 and result["skipped"] == 2


def test_letter_matching():
    shown = ["red", "green", "blue"]
    for text in ["B", "(C) blue", "The answer is A.", "green", "A or B", "reddish", "blue and red", "nothing"]:
        assert mmbench.infer_letter(text, shown) == picks(text, shown), text


def read_xlsx(path) -> list[list]:
    """The first sheet's rows, read with the standard library (cell references placed by column letter)."""
    import re
    import zipfile
    from xml.etree import ElementTree

    ns = {"m": "http://schemas.openxmlformats.org/spreadsheetml/2006/main"}
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        assert {"[Content_Types].xml", "_rels/.rels", "xl/workbook.xml", "xl/_rels/workbook.xml.rels"} <= names
        sheets = ElementTree.fromstring(z.read("xl/workbook.xml")).findall("m:sheets/m:sheet", ns)
        assert [s.get("name") for s in sheets] == ["Sheet1"]
        root = ElementTree.fromstring(z.read("xl/worksheets/sheet1.xml"))
    rows = []
    for row in root.findall("m:sheetData/m:row", ns):
        cells: dict[int, object] = {}
        for c in row.findall("m:c", ns):
            letters = re.match(r"[A-Z]+", c.get("r")).group()
            col = 0
            for ch in letters:
                col = col * 26 + ord(ch) - ord("A") + 1
            if c.get("t") == "inlineStr":
                cells[col - 1] = "".join(t.text or "" for t in c.iter(f"{{{ns['m']}}}t"))
            else:
                cells[col - 1] = int(c.find("m:v", ns).text)
        rows.append([cells.get(i) for i in range(max(cells) + 1)] if cells else [])
    return rows


def test_mmbench_test_upload_as_convert_mmbench_for_submission(tiny_checkpoint, tmp_path, capsys):
    """One round per row (LLaVA's mmbench.sh has no --all-rounds); the xlsx holds the TSV's columns without hint,
    category, source, image, comment, l2-category, with ``prediction`` inserted at position 6."""
    make_mmbench(tmp_path)
    dev = tmp_path / "mmbench" / mmbench.DEV_FILE
    lines = dev.read_text().splitlines()
    header = lines[0].split("\t")
    drop = header.index("answer")  # the test split has no answer column
    test_rows = [[c for i, c in enumerate(line.split("\t")) if i != drop] for line in lines]
    (tmp_path / "mmbench" / mmbench.TEST_FILE).write_text("".join("\t".join(r) + "\n" for r in test_rows))
    dev.unlink()
    result, answers = run_suite("mmbench_test", tiny_checkpoint, tmp_path, tmp_path / "out", capsys)
    assert [(a["question_id"], a["round_id"]) for a in answers] == [(0, 0), (1, 0)]
    got = read_xlsx(tmp_path / "out" / mmbench.UPLOAD_FILE)
    kept = [c for c in test_rows[0] if c not in ("hint", "category", "source", "image", "comment", "l2-category")]
    assert kept == ["index", "question", "A", "B", "C", "D", "split"]
    assert got[0] == ["index", "question", "A", "B", "C", "D", "prediction", "split"]
    texts = {a["question_id"]: a["text"] for a in answers}
    assert got[1] == [0, "What colour is it?", "red", "green", "blue", "black", texts[0], "dev"]
    # absent options (nan in the TSV) are empty cells, as pandas writes its NaN
    assert got[2] == [1, "How many?", "one", "two", None, None, texts[1], "dev"]
    assert result["n"] == 2 and result["answered"] == 2
