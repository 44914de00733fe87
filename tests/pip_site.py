"""Older library versions for tests that compare against them: ``pip install --no-deps --target`` into a directory
cached under ``~/.cache/neva-tests`` (``NEVA_TEST_CACHE``), built once, put on ``PYTHONPATH`` in front of the test
venv's own packages (torch, pillow, ... come from the venv: no second torch is installed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("NEVA_TEST_CACHE", Path.home() / ".cache" / "neva-tests"))


def cached_site(name: str, pins: tuple[str, ...], timeout: float = 300) -> Path:
    """``CACHE / name`` holding ``pins`` (installed without dependencies); skip the test when pip cannot install."""
    site = CACHE / name
    marker = site / ".complete"
    if not marker.is_file():
        tmp = site.with_name(site.name + f".tmp{os.getpid()}")
        # --no-compile: byte-compiling every module of transformers doubles the install time; what a test imports is
        # compiled on first import.
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--retries", "1",
               "--timeout", "20", "--target", str(tmp), *pins]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            error = proc.stderr[-300:] if proc.returncode else ""
        except subprocess.TimeoutExpired:
            error = f"pip did not finish in {timeout:.0f} s"
        if error:
            shutil.rmtree(tmp, ignore_errors=True)
            pytest.skip(f"cannot build the {name} environment (no package index?): {error}")
        (tmp / ".complete").write_text("")
        if marker.is_file():  # another process built it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            shutil.rmtree(site, ignore_errors=True)
            tmp.rename(site)
    return site
