"""The family and stage specs (``neva.families``, ``neva.stages``): each part lives in the package that resolves it,
generic code never branches on a family's name, and a family's presets are its spec's (docs/ARCHITECTURE.md, "Adding a
family", "Adding a stage")."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

import neva
from neva.families import DECODERS, TOWERS, part
from neva.families.spec import PART_OWNERS
from neva.models.config import LLMConfig, VisionConfig
from neva.models.presets import (
    GENERIC_LLM_PRESETS,
    GENERIC_VISION_PRESETS,
    LLM_PRESETS,
    VISION_PRESETS,
    gather_presets,
)
from neva.stages import STAGES
from neva.stages.spec import PART_OWNERS as STAGE_PART_OWNERS

ROOT = Path(neva.__file__).parent
NAMES = set(TOWERS) | set(DECODERS) | set(STAGES)
# What a branch on a family or stage reads: ``vision.kind == "qwen2_vl"``, ``llm.family in (...)``, ``cfg.stage``.
SUBJECTS = {"kind", "family", "tower", "text_family", "stage"}


@pytest.mark.parametrize(
    "spec", [*TOWERS.values(), *DECODERS.values()], ids=lambda s: getattr(s, "kind", None) or s.name
)
def test_each_part_resolves_inside_the_package_that_owns_it(spec):
    for field, path in spec.parts().items():
        assert path.startswith(PART_OWNERS[field] + "."), f"{spec}.{field} = {path} outside {PART_OWNERS[field]}"
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
    specs = [*TOWERS.values(), *DECODERS.values(), *STAGES.values()]
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


@pytest.mark.parametrize(
    "gathered, generic, specs",
    [(VISION_PRESETS, GENERIC_VISION_PRESETS, TOWERS), (LLM_PRESETS, GENERIC_LLM_PRESETS, DECODERS)],
    ids=["vision", "llm"],
)
def test_every_preset_has_one_owner(gathered, generic, specs):
    """Each preset name is the generic list's or one spec's, and the gathered table holds that very shape."""
    owners = [("neva.models.presets", generic), *((name, spec.presets) for name, spec in specs.items())]
    counts = Counter(name for _, presets in owners for name in presets)
    assert [name for name, n in counts.items() if n > 1] == []
    assert set(counts) == set(gathered)
    for _, presets in owners:
        for name, fields in presets.items():
            assert gathered[name] is fields


def test_gathering_refuses_a_preset_name_twice():
    with pytest.raises(TypeError, match=r"^two presets are called 'x': tower spec 'a''s and tower spec 'b''s$"):
        gather_presets({}, [("tower spec 'a'", {"x": {}}), ("tower spec 'b'", {"x": {"num_layers": 1}})])
    with pytest.raises(TypeError, match=r"^two presets are called 'tiny': neva.models.presets's and decoder spec"):
        gather_presets({"tiny": {}}, [("decoder spec 'llama'", {"tiny": {}})])


@pytest.mark.parametrize("spec", [*TOWERS.values()], ids=lambda s: s.kind)
def test_a_tower_familys_presets_are_of_its_kind(spec):
    for name, fields in spec.presets.items():
        assert VisionConfig(**fields).kind == spec.kind, name


@pytest.mark.parametrize("spec", [*DECODERS.values()], ids=lambda s: s.name)
def test_a_decoder_familys_presets_are_of_its_family(spec):
    for name, fields in spec.presets.items():
        assert LLMConfig(**fields).family == spec.name, name
