"""AnyRes pays on the detail set (neva.data.synthetic_detail): the same seeded short tiny-model run (pretrain then
finetune, one thread), once at the tower's fixed resolution and once with AnyRes tiles, then ``neva.evaluate --suite
detail``; AnyRes must beat the fixed resolution by a margin, their 95 % Wilson intervals apart. docs/DATA.md ("The
detail set") holds the measured numbers."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.parallel.harness import run_module

# One thread per run, the two runs side by side: the numbers are bitwise the same on any machine and under any load.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
COMMON = [
    "data=synthetic_detail",
    "model.data.system_prompt=",
    "model.data.packing=true",
    "model.data.synthetic_train_samples=2000",
    "model.data.synthetic_val_samples=16",
    "trainer.limit_val_batches=0",
    "trainer.enable_progress_bar=false",
    "exp_manager.create_tensorboard_logger=false",
    "recipe.pretrain.lr=2e-3",
    "recipe.pretrain.max_steps=10",
    "recipe.finetune.lr=3e-3",
    "recipe.finetune.max_steps=60",
]
ANYRES = ["model.mm_cfg.image_grid_pinpoints='(1x1),...,(2x2)'", "model.data.image_aspect_ratio=anyres"]
LIMIT = 150


def run(*args: str, env: dict[str, str]) -> str:
    """``python -m module *args`` (``args``: ``"-m", module, ...``), forked from the session's server
    (``tests.parallel.harness.run_module``: no interpreter start-up); its stdout."""
    flag, module, *argv = args
    assert flag == "-m", args
    out = run_module(module, argv, env=env, timeout=3600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def train_and_evaluate(root, extra: list[str]) -> dict:
    env = {**ENV, "NEVA_OUTPUT_ROOT": str(root)}
    run("-m", "neva.train", "+stage=pretrain", *COMMON, *extra, env=env)
    run("-m", "neva.train", "+stage=finetune", *COMMON, *extra, env=env)
    checkpoint = str(root / "finetune" / "final")
    return json.loads(run("-m", "neva.evaluate", "--suite", "detail", "--limit", str(LIMIT), "--checkpoint",
                          checkpoint, env=env))  # fmt: skip


@pytest.mark.slow
def test_anyres_beats_fixed_resolution_on_the_detail_set(tmp_path):
    with ThreadPoolExecutor(2) as pool:
        fixed, anyres = pool.map(train_and_evaluate, [tmp_path / "fixed", tmp_path / "anyres"], [[], ANYRES])
    print(json.dumps({"fixed": fixed, "anyres": anyres}))  # the numbers docs/DATA.md shows (pytest -s)
    assert not fixed["anyres"] and anyres["anyres"] and fixed["n"] == anyres["n"] == LIMIT
    assert anyres["accuracy"] >= fixed["accuracy"] + 0.2, (fixed, anyres)
    assert anyres["ci95"][0] > fixed["ci95"][1], (fixed, anyres)
