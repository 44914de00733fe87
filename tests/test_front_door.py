"""The README as the front door: its generated tables are the code's answers, and its first lines stay first.

The support matrix is ``python -m neva.support`` (every "no" is a start-time check's own refusal); the recipes table
is ``python -m neva.recipes`` (the planner's prediction for each shipped preset). Both are compared with the README
verbatim, so neither can drift from the code.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from neva import recipes, support

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FIRST_LINES = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && python -m neva.train "
    "+stage=pretrain && python -m neva.train +stage=finetune && python -m neva.evaluate\npython -m pytest -q\n"
)


def section(begin: str) -> str:
    """The README's text between ``<!-- begin: {begin} -->`` and the next ``<!-- end -->``."""
    match = re.search(rf"<!-- begin: {re.escape(begin)} -->\n(.*?)\n<!-- end -->", README, re.S)
    assert match, f"README.md has no '<!-- begin: {begin} -->' ... '<!-- end -->' section"
    return match.group(1)


@pytest.fixture(scope="module")
def matrix() -> str:
    # Not timed: the README quotes its time from a measurement (docs/PERFORMANCE.md), tests assert no durations.
    return support.matrix()


def test_readme_starts_with_the_two_fresh_machine_lines():
    first_block = README.split("```bash\n", 1)[1].split("```", 1)[0]
    assert first_block == FIRST_LINES
    assert README.index("```bash") < README.index("## ")  # before any section


def test_readme_support_matrix_is_the_codes(matrix):
    assert section("python -m neva.support") == matrix, "paste the output of `python -m neva.support` into README.md"


def cells(table: str) -> dict[str, dict[str, str]]:
    """``{row label: {column label: cell}}`` of the matrix's Markdown."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("| ")]
    header, body = rows[0], rows[1:]
    return {row[0]: dict(zip(header[1:], row[1:])) for row in body}


def test_matrix_answers_are_the_refusals(matrix):
    got = cells(matrix)
    default = got["CLIP + Llama, mlp2x_gelu, fixed resolution (the default)"]
    # O2 keeps its masters in FSDP2; expert parallelism needs experts
    assert {k for k, v in default.items() if v.startswith("no")} == {"O2, DDP", "EP 2"}
    assert got["Mixtral MoE decoder"]["EP 2"] == "yes"
    assert got["Qwen2 decoder (tied embeddings)"]["PP 2"].startswith("no")
    assert got["Mistral decoder (sliding window)"]["LLaVA-original import"] == "yes"  # llava_mistral
    assert got["LoRA finetune"]["TP 2"].startswith("no") and got["trained vision tower"]["TP 2"].startswith("no")
    assert got["AnyRes (LLaVA-NeXT)"]["HF export + import"] == "llava_next"
    assert got["AnyRes anyres_max_N (OneVision)"]["HF export + import"] == "llava_onevision"
    # neva.train's video models share the image token's id, which LlavaNextVideo cannot tell apart
    assert got["video + AnyRes images"]["HF export + import"].startswith("no")
    assert got["video, fixed-resolution images"]["HF export + import"].startswith("no")
    assert got["mlp_downsample projector (NeMo)"]["HF export + import"].startswith("no")
    assert got["mlp_downsample projector (NeMo)"]["LLaVA-original import"].startswith("no")
    assert got["Mixtral MoE decoder"]["LLaVA-original import"].startswith("no")
    assert got["video + AnyRes images"]["LLaVA-original import"] == "images only"
    assert default["LLaVA-original export"] == got["Qwen2 decoder (tied embeddings)"]["LLaVA-original export"] == "yes"
    assert got["SigLIP tower"]["LLaVA-original export"].startswith("no")  # LLaVA's CLIPVisionTower
    qwen = got["Qwen2.5-VL: native resolution, M-RoPE"]
    assert qwen["HF export + import"] == "qwen2_5_vl" and qwen["LLaVA-original import"].startswith("no")
    assert default["CP 2"] == qwen["CP 2"] == "yes"  # a native tower's items shared out over the cp ranks


def test_matrix_notes_are_the_refusal_messages(matrix):
    table = matrix
    assert "model.megatron_amp_O2=true keeps fp32 master weights through FSDP2" in table
    assert "tied word embeddings cannot be split over pipeline stages" in table


def test_readme_recipes_table_is_the_planners():
    assert section("python -m neva.recipes") == recipes.table(), "paste `python -m neva.recipes` into README.md"


# Where dated measurements live. docs/TRAINING.md's trial notes move to docs/notes.md with the DPO stage's rewrite of
# that file (another change owns it this round).
DATED_OK = {"PERFORMANCE.md", "notes.md", "TRAINING.md"}
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
MEASURED = re.compile(r"[Mm]easured|\bwall\b|CPU time|\bload\b|\bTried\b")


def test_dated_measurements_live_in_performance_and_notes():
    docs = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in DATED_OK)]
    dated = [
        f"{path.name}:{n}: {line.strip()}"
        for path in docs
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if DATE.search(line) and MEASURED.search(line)
    ]
    assert not dated, "move these to docs/PERFORMANCE.md (numbers) or docs/notes.md (trials):\n" + "\n".join(dated)
