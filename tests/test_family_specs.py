"""The family and stage specs (``neva.families``, ``neva.stages``): each part lives in the package that resolves it,
and generic code never branches on a family's name (docs/ARCHITECTURE.md, "Adding a family", "Adding a stage")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import neva
from neva.families import DECODERS, TOWERS, part
from neva.families.spec import PART_OWNERS
from neva.stages import STAGES
from neva.stages.spec import PART_OWNERS as STAGE_PART_OWNERS

ROOT = Path(neva.__file__).parent
NAMES = set(TOWERS) | set(DECODERS) | set(STAGES)
# What a branch on a family or stage reads: ``vision.kind == "qwen2_vl"``, ``llm.family in (...)``, ``cfg.stage``.
SUBJECTS = {"kind", "family", "tower", "text_family", "stage"}


@pytest.mark.parametrize("spec", [*TOWERS.values()], ids=lambda s: s.kind)
def test_each_part_resolves_inside_the_package_that_owns_it(spec):
    for field, path in spec.parts().items():
        assert path.startswith(PART_OWNERS[field] + "."), f"{spec.kind}.{field} = {path} outside {PART_OWNERS[field]}"
        assert part(path) is not None


@pytest.mark.parametrize("spec", [*STAGES.values()], ids=lambda s: s.name)
def test_each_stage_part_resolves_inside_the_package_that_owns_it(spec):
    for field, path in spec.parts().items():
        owner = STAGE_PART_OWNERS[field]
        assert path.startswith(owner + "."), f"{spec.name}.{field} = {path} outside {owner}"
        assert callable(part(path))
    if spec.starts_from is not None:
        assert spec.starts_from[0] in STAGES


def _subject(node: ast.expr) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def _branches(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each comparison of a family-ish subject with a family's name."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if not any(_subject(s) in SUBJECTS for s in sides):
            continue
        for side in sides:
            consts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            out += [(node.lineno, c.value) for c in consts if isinstance(c, ast.Constant) and c.value in NAMES]
    return out


def test_no_branch_on_a_family_or_stage_name_outside_their_own_modules():
    """A family's or stage's own modules (those its spec names as parts, and ``neva/families``, ``neva/stages``) may
    tell their members apart; every other module asks the spec."""
    specs = [*TOWERS.values(), *STAGES.values()]
    own = {path.partition(":")[0] for spec in specs for path in spec.parts().values()}
    found = []
    for path in ROOT.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        if module.startswith(("neva.families", "neva.stages")) or module in own:
            continue
        found += [f"{module}:{line} {name!r}" for line, name in _branches(ast.parse(path.read_text()))]
    assert not found, "generic code branches on a family's or stage's name (ask its spec): " + ", ".join(found)


def test_the_scan_sees_a_branch():
    assert _branches(ast.parse('if vision.kind == "qwen2_5_vl": pass')) == [(1, "qwen2_5_vl")]
    assert _branches(ast.parse('if llm.family in ("mixtral", "qwen3_moe"): pass')) == [(1, "mixtral"), (1, "qwen3_moe")]
