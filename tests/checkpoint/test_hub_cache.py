"""Hub ids (``org/name``) resolve through the local HF cache only (``HF_HOME``), never by a download."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from neva.checkpoint.hf_import import import_llava
from neva.checkpoint.neva_format import iter_tensors
from tests.checkpoint.tiny_hf import make_clip_dir, make_llama_dir, make_llava_dir

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"

# One process with the cache's HF_HOME (huggingface_hub reads it at import): a convert by Hub id, a run's source by
# Hub ids, and a Hub id the cache does not hold.
SCRIPT = """
import json, sys
from neva.config import compose_config
from neva.checkpoint.source import resolve_source
from neva.convert import main
from neva.hf_local import LocalModelError, model_dir
main(["hf-to-neva", "--hf", "org/tiny-llava", "--out", sys.argv[1]])
cfg = compose_config(["+stage=pretrain", "model.mm_cfg.llm.from_pretrained=org/tiny-llama",
                      "model.mm_cfg.vision_encoder.from_pretrained=org/tiny-clip"])
source = resolve_source(cfg)
try:
    model_dir("org/not-cached")
    missing = None
except LocalModelError as err:
    missing = str(err)
print(json.dumps({"llm": source.hf_llm, "vision": source.hf_vision, "hidden": source.cfg.llm.hidden_size,
                  "missing": missing}))
"""


def cache_repo(hf_home: Path, repo_id: str) -> Path:
    """The snapshot directory of ``repo_id`` in huggingface_hub's cache layout, with ``refs/main`` pointing to it."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return repo / "snapshots" / SNAPSHOT


def test_hub_ids_resolve_through_the_local_cache_offline(tmp_path):
    hf_home = tmp_path / "hf"
    llava_dir = cache_repo(hf_home, "org/tiny-llava")
    make_llava_dir(llava_dir)
    llama, _ = make_llama_dir(cache_repo(hf_home, "org/tiny-llama"))
    make_clip_dir(cache_repo(hf_home, "org/tiny-clip"))
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "by_id")], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(report["llm"]) == hf_home / "hub" / "models--org--tiny-llama" / "snapshots" / SNAPSHOT
    assert Path(report["vision"]).name == SNAPSHOT and report["hidden"] == llama.config.hidden_size
    assert "org/not-cached" in report["missing"] and "hf download org/not-cached" in report["missing"]
    # The conversion by Hub id is the conversion of the directory.
    by_dir = import_llava(llava_dir, tmp_path / "by_dir")
    expected = dict(iter_tensors(by_dir))
    got = dict(iter_tensors(tmp_path / "by_id"))
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
