"""Every preset resolves to the values docs/PRESETS.md documents, and every documented key names its source.

docs/PRESETS.md is the one source of truth: its "Resolved values" tables (first header cell ``preset``, the others
backticked config keys) are parsed here and compared with ``compose_config(["+preset=<name>"])``, so a preset that
drifts from its documented recipe, a preset without a row, or a key without a source row fails.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import compose, initialize_config_dir

from neva.config import CONFIG_DIR, to_train_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "PRESETS.md"
PRESETS = sorted(p.stem for p in (Path(CONFIG_DIR) / "preset").glob("*.yaml"))


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _value(cell: str) -> Any:
    value = yaml.safe_load(cell)
    if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string; the configs (OmegaConf) read it as a float
        try:
            return float(value)
        except ValueError:
            return value
    return value


def documented_values() -> dict[str, dict[str, Any]]:
    """preset → {config key: documented value}, from every table whose first header cell is ``preset``."""
    table: dict[str, dict[str, Any]] = {}
    keys: list[str] | None = None
    for line in DOC.read_text().splitlines():
        if not line.startswith("|"):
            keys = None
            continue
        cells = _cells(line)
        if cells[0] == "preset":
            keys = [c.strip("`") for c in cells[1:]]
        elif keys is not None and cells[0].startswith("`"):
            row = table.setdefault(cells[0].strip("`"), {})
            row.update({k: _value(c) for k, c in zip(keys, cells[1:], strict=True)})
    return table


def documented_sources() -> dict[str, set[str]]:
    """Family prefix (``### `nemo_llama2_*` ``) → the keys its source table names."""
    sources: dict[str, set[str]] = {}
    family = None
    for line in DOC.read_text().splitlines():
        if m := re.match(r"### `(\w+)\*`", line):
            family = m.group(1)
            sources[family] = set()
        elif line.startswith("###") or line.startswith("## "):
            family = None
        elif family is not None and line.startswith("| `"):
            sources[family].update(re.findall(r"`([\w.]+)`", _cells(line)[0]))
    return sources


def resolved(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_every_preset_is_documented_and_every_key_has_a_source():
    table = documented_values()
    assert sorted(table) == PRESETS
    sources = documented_sources()
    for name, values in table.items():
        family = max((f for f in sources if name.startswith(f)), key=len)
        assert set(values) <= sources[family], (name, sorted(set(values) - sources[family]))


@pytest.fixture(scope="module")
def composed():
    """Every preset as ``compose_config([f"+preset={name}"])`` gives it, under one Hydra initialisation (cheaper)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return {name: to_train_config(compose("neva", overrides=[f"+preset={name}"])) for name in PRESETS}


@pytest.mark.parametrize("name", PRESETS)
def test_preset_resolves_to_its_documented_values(composed, name):
    expected = documented_values()[name]
    got = {key: resolved(composed[name], key) for key in expected}
    assert got == expected
