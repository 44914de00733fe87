"""The import graph of ``neva/``: dependencies point one way and no module imports itself back through others.

Layers, lowest first: a module may import its own package and any lower layer, never a higher one or a sibling
package of its own layer. Every import counts, including those inside functions (a lazy import is still a
dependency, only a hidden one).
"""

from __future__ import annotations

import ast
from pathlib import Path

import neva

ROOT = Path(neva.__file__).parent

LAYERS: list[tuple[str, ...]] = [
    ("neva", "neva.errors"),
    ("neva.constants", "neva.typed", "neva.hf_local"),
    # one spec per model family and per training stage; their code parts named by path, resolved by their owners
    ("neva.families", "neva.stages"),
    ("neva.nemo_keys",),
    ("neva.models",),
    ("neva.data",),
    ("neva.config",),
    ("neva.checkpoint",),
    ("neva.parallel",),
    ("neva.training", "neva.planner", "neva.inference", "neva.benchmarks"),
    ("neva.synthetic_suites",),  # the synthetic suites' questions and scores, on an Answerer
    ("neva.training_eval",),  # the benchmarks and the inference front end on the training model, for neva.train
    (
        "neva.train",
        "neva.generate",
        "neva.evaluate",
        "neva.convert",
        "neva.plan",
        "neva.plot",
        "neva.support",
        "neva.recipes",
    ),
]
UNIT_LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """The layer unit a module belongs to: its top-level package or file under ``neva``."""
    parts = module.split(".")
    return ".".join(parts[:2])


def imports(path: Path, module: str) -> set[str]:
    """The ``neva`` modules ``path`` imports (relative imports resolved; ``from pkg import mod`` gives ``pkg.mod``
    when that is a module)."""
    out = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "neva"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "neva":
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                out.add(candidate if _exists(candidate) else base)
    return out


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p, module_name(p)) for p in sorted(ROOT.rglob("*.py"))}


def test_every_module_has_a_layer():
    missing = sorted({unit_of(m) for m in graph()} - set(UNIT_LAYER))
    assert not missing, f"add these to LAYERS in {__file__}: {missing}"


def test_no_upward_or_sideways_import():
    bad = []
    for module, targets in graph().items():
        src = unit_of(module)
        for target in targets:
            dst = unit_of(target)
            if dst == src or dst == "neva":
                continue
            if UNIT_LAYER[dst] >= UNIT_LAYER[src]:
                bad.append(f"{module} imports {target} ({src} is layer {UNIT_LAYER[src]}, {dst} is {UNIT_LAYER[dst]})")
    assert not bad, "imports against the layer order:\n" + "\n".join(sorted(bad))


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt in edges and state.get(nxt) is None:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for module in sorted(edges):
        if state.get(module) is None:
            cycle = visit(module)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)
