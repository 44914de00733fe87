"""Each benchmark's few questions as its Hugging Face dataset ships them (parquet, images embedded as PNG bytes;
Video-MME's videos and subtitles as lmms-eval unpacks them), with crafted answers that exercise every parsing and
normalisation rule of its scorer: shared by the scorer tests (against lmms-eval) and the end-to-end run."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from tests.data.video_files import write_video


def png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_parquet(path, docs: list[dict], images: tuple[str, ...] = ("image",)) -> None:
    """``docs`` as ``datasets`` writes a split: image columns as ``{bytes, path}`` structs (one image per doc and
    column, an absent one null), two row groups."""
    rows = [{**d, **{c: {"bytes": png(i * 7 + k), "path": None} if d.get(c, True) is not None else None
                     for k, c in enumerate(images)}} for i, d in enumerate(docs)]  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=max(1, len(rows) // 2))


MC = str(["cat", "dog", "bird", "fish"])
MMMU_MC_ANSWERS = ["(B)", "B", "The answer is C.", "I think it is clearly the dog in the picture", "A or B", "hmm",
                   "(A) no wait (B)", "", "Neither of them fits at all here", "D. fish"]  # fmt: skip
MMMU_OPEN = [("3.14", "The answer is 3.14"), ("1234", "it is 1,234 dollars"), ("paris", "The capital is Paris."),
             ("x", "so x"), ("42", "3 + 39 = 42"), ("7", "Seven"), ("2.5e3", "2500"), ("1.5", "about 1.49")]  # fmt: skip
SUBJECTS = ("Art", "Math", "History", "Computer_Science")


def mmmu_case():
    docs, answers = [], []
    for i, text in enumerate(MMMU_MC_ANSWERS):
        two = i == 0
        docs.append({"id": f"validation_{SUBJECTS[i % 4]}_{i}", "question_type": "multiple-choice", "options": MC,
                     "answer": "B", "question": f"<image 1> Which animal is this?{' Compare <image 2>.' if two else ''}",
                     "image_2": {} if two else None})  # fmt: skip
        answers.append(text)
    for i, (gold, text) in enumerate(MMMU_OPEN):
        docs.append({"id": f"validation_{SUBJECTS[i % 4]}_{100 + i}", "question_type": "open", "options": "[]",
                     "answer": gold, "question": "<image 1> What value is shown?", "image_2": None})  # fmt: skip
        answers.append(text)
    return docs, answers


def mmstar_case():
    letters = ("A", "B", "C", "D")
    texts = ["A", "(B)", "The answer is C", "c", "I choose D.", "", "Answer: B", "A. apple", "BAD", "D) dog",
             "Option B: the second"]  # fmt: skip
    cats = [("coarse perception", "image emotion"), ("coarse perception", "image scene and topic"),
            ("math", "geometry"), ("math", "geometry"), ("math", "statistical reasoning")]  # fmt: skip
    docs = [{"index": i, "question": "  Which one?\nOptions: A: apple, B: ball, C: cat, D: dog Please answer yes or no.",
             "answer": letters[i % 4], "category": cats[i % 5][0], "l2_category": cats[i % 5][1]}
            for i in range(len(texts))]  # fmt: skip
    return docs, texts


def ai2d_case():
    texts = ["B. dog", "  B. ", "(b)", "B!", "B is right", "b.", "dog", "A", "b"]
    docs = [{"question": f"What is shown {i}?", "options": ["cat", "dog", "bird"], "answer": "1"} for i in range(9)]
    return docs, texts


def ocrbench_case():
    rows = [("Regular Text Recognition", "IIIT5K", ["CENTRE"], "centre"),
            ("Handwritten Mathematical Expression Recognition", "HME100k", ["x ^ { 2 }"], "x^{2}"),
            ("Handwritten Mathematical Expression Recognition", "HME100k", ["X ^ 2"], "x^2"),
            ("Doc-oriented VQA", "docVQA", ["$12.50", "12.50"], "Total: ＄12.50"),
            ("Key Information Extraction", "SROIE", ["ABC\nSDN BHD"], "abc sdn bhd"),
            ("Scene Text-centric VQA", "textVQA", ["stop"], "go"),
            ("Artistic Text Recognition", "WordArt", ["hello world"], "HELLO\u3000WORLD")]  # fmt: skip
    docs = [{"question_type": t, "dataset": d, "answer": a, "question": f" what is written? {i} "}
            for i, (t, d, a, _) in enumerate(rows)]  # fmt: skip
    return docs, [r[3] for r in rows]


def docvqa_case():
    rows = [(["Total"], "total"), (["New  York"], " new york "), (["invoice"], "invoise"), (["12 May"], "May"),
            (["a", "abcdef"], "abcdeg"), (["straße"], "strasse"), (["x"], "")]  # fmt: skip
    docs = [{"questionId": str(100 + i), "question": f"What is it {i}?", "answers": a} for i, (a, _) in enumerate(rows)]
    return docs, [r[1] for r in rows]


def chartqa_case():
    rows = [("human_test", "12.5", "12"), ("augmented_test", "0.5", "50%"), ("human_test", "0", "0"),
            ("augmented_test", "Yes", "yes"), ("human_test", "1000", "1,000"), ("augmented_test", "100", "94")]  # fmt: skip
    docs = [{"type": t, "answer": a, "question": f"How many {i}?"} for i, (t, a, _) in enumerate(rows)]
    return docs, [r[2] for r in rows]


def realworldqa_case():
    rows = [("A", "A."), ("B", "(B)"), ("Downhill", "downhill."), ("0", "0"), ("3", "three"), ("C", "The answer is D"),
            ("D", "d")]  # fmt: skip
    docs = [{"question": f" Which way? {i}\nPlease answer directly with only the letter of the correct option and "
             "nothing else. ", "answer": a} for i, (a, _) in enumerate(rows)]  # fmt: skip
    return docs, [r[1] for r in rows]


def hallusionbench_case():
    rows = [("VD", "illusion", 0, 0, 0, "1", "Yes, it is."), ("VD", "illusion", 0, 1, 0, "0", "No"),
            ("VD", "illusion", 0, 0, 1, "0", "I don't know, yes maybe"), ("VD", "illusion", 0, 1, 1, "1", "YES"),
            ("VS", "chart", 1, 0, 0, "1", "yes"), ("VS", "chart", 1, 1, 0, "1", "yes"),
            ("VS", "chart", 2, 0, 0, "0", "no, eyes closed")]  # fmt: skip
    docs = [{"category": c, "subcategory": s, "set_id": str(st), "figure_id": str(f), "question_id": str(q),
             "gt_answer": g, "gt_answer_details": "details", "question": f"Is it so {i}?"}
            for i, (c, s, st, f, q, g, _) in enumerate(rows)]  # fmt: skip
    return docs, [r[6] for r in rows]


def mathvista_case():
    meta = {"split": "testmini", "language": "english", "source": "FunctionQA", "category": "math-targeted-vqa",
            "task": "figure question answering", "context": "function plot", "grade": "college",
            "skills": ["algebraic reasoning"]}  # fmt: skip
    choices = ["hong kong", "osaka", "shanghai", "tokyo"]
    rows = [("multi_choice", "text", choices, None, "tokyo", "tokyo", ""), ("multi_choice", "text", choices, None,
            "tokyo", "(D)", ""), ("multi_choice", "text", choices, None, "osaka", "", ""),
            ("free_form", "integer", None, None, "12", "12", ""), ("free_form", "integer", None, None, "12", "12.0", ""),
            ("free_form", "float", None, 1.0, "1.5", "1.50", "cm"), ("free_form", "float", None, 2.0, "1.46", "1.456", ""),
            ("free_form", "float", None, 1.0, "2.5", "about 2.5", ""), ("free_form", "list", None, None, "[1, 2]", "[1, 2]", "")]  # fmt: skip
    docs = [{"pid": str(i + 1), "question": f"What is the value {i}?", "choices": c, "precision": p, "answer": a,
             "question_type": qt, "answer_type": at, "unit": u, "query": f"query {i}", "metadata": meta}
            for i, (qt, at, c, p, a, _, u) in enumerate(rows)]  # fmt: skip
    return docs, [r[5] for r in rows]


SRT = """1
00:00:00,000 --> 00:00:01,500
<font color="white" size=".72c">Hello there</font>

2
00:00:01,500 --> 00:00:02,000
<font color="white" size=".72c">Second line</font>

3
00:00:03,000 --> 00:00:03,900
no font tag here
"""


def videomme_case():
    rows = [("v1", "short", "Knowledge", "Astronomy", "Counting Problem", "A", "A"),
            ("v1", "short", "Knowledge", "Astronomy", "OCR Problems", "B", "The answer is B."),
            ("v2", "medium", "Sports Competition", "Football", "Action Recognition", "C", "D"),
            ("v2", "medium", "Sports Competition", "Football", "Action Recognition", "D", "(D) gray"),
            ("v3", "long", "Multilingual", "Multilingual", "Information Synopsis", "A", "none")]  # fmt: skip
    docs = [{"videoID": v, "duration": d, "domain": dom, "sub_category": sub, "task_type": t, "answer": a,
             "question_id": f"{i:03d}-1", "video_id": f"{i:03d}", "url": "https://example.invalid",
             "question": f"What colour is it {i}?", "options": ["A. red", "B. blue", "C. green", "D. gray"]}
            for i, (v, d, dom, sub, t, a, _) in enumerate(rows)]  # fmt: skip
    return docs, [r[6] for r in rows]


def write_videomme(folder) -> None:
    """lmms-eval's videomme/ cache folder: the parquet, data/<id>.mp4, subtitle/<id>.srt (v2 has none; v3's cues
    are past its frames)."""
    docs, _ = videomme_case()
    write_parquet(folder / "videomme" / "test-00000-of-00001.parquet", docs, images=())
    for video in ("v1", "v2", "v3"):
        write_video(folder / "videomme" / "data" / f"{video}.mp4", frames=40, size=32, rate=10)
    (folder / "videomme" / "subtitle").mkdir(parents=True)
    (folder / "videomme" / "subtitle" / "v1.srt").write_text(SRT)
    (folder / "videomme" / "subtitle" / "v3.srt").write_text(SRT.replace("00:00:0", "00:00:1"))


CASES = {"mmmu": mmmu_case, "mmstar": mmstar_case, "ai2d": ai2d_case, "ocrbench": ocrbench_case,
         "docvqa": docvqa_case, "chartqa": chartqa_case, "realworldqa": realworldqa_case,
         "hallusionbench": hallusionbench_case, "mathvista": mathvista_case, "videomme": videomme_case}  # fmt: skip


# Where each case's files go under a --data-dir: (folder/split file, image columns)
LAYOUT = {
    "mmmu": ("MMMU/Art/validation-00000-of-00001.parquet", ("image_1", "image_2")),
    "mmstar": ("MMStar/mmstar.parquet", ("image",)),
    "ai2d": ("ai2d/data/test-00000-of-00001.parquet", ("image",)),
    "ocrbench": ("OCRBench/data/test-00000-of-00001.parquet", ("image",)),
    "docvqa": ("DocVQA/DocVQA/validation-00000-of-00001.parquet", ("image",)),
    "chartqa": ("ChartQA/data/test-00000-of-00001.parquet", ("image",)),
    "realworldqa": ("RealWorldQA/data/test-00000-of-00001.parquet", ("image",)),
    "hallusionbench": ("HallusionBench/data/image-00000-of-00001.parquet", ("image",)),
    "mathvista": ("MathVista/data/testmini-00000-of-00001.parquet", ("decoded_image",)),
}


def write_snapshots(root) -> None:
    """Every case under ``root`` as ``--data-dir`` holds the snapshots (the folder each benchmark's row names); AI2D's
    no-mask copy, InfographicVQA and both test splits (no answers) from the same docs."""
    for name, (path, images) in LAYOUT.items():
        write_parquet(root / path, CASES[name]()[0], images)
    docs, _ = docvqa_case()
    write_parquet(root / "ai2d-no-mask/data/test-00000-of-00001.parquet", ai2d_case()[0])
    write_parquet(root / "DocVQA/InfographicVQA/validation-00000-of-00001.parquet", docs)
    for subset in ("DocVQA", "InfographicVQA"):
        test = [{k: v for k, v in d.items() if k != "answers"} for d in docs]
        write_parquet(root / f"DocVQA/{subset}/test-00000-of-00001.parquet", test)
    write_videomme(root)
