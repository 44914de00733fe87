"""lmms-eval 0.7.3's own prompts and scores, for the tests of the benchmarks it defines: one subprocess
(``lmms_driver.py``) in a side environment of lmms-eval and the pure-Python packages its task modules import
(``--no-deps``: torch, numpy, pillow, pyarrow, transformers come from the test venv; no CUDA torchvision, which no
scorer needs), built once and cached (``tests/pip_site.py``); the test skips, naming why, where it cannot be built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pip_site import cached_site

LMMS_PINS = ("lmms_eval==0.7.3", "datasets==5.2.0", "evaluate==0.4.6", "dill==0.4.1", "multiprocess==0.70.19",
             "xxhash==4.1.0", "pandas==3.1.1", "pytz==2026.6", "loguru==0.7.3", "pyyaml==6.0.4", "tenacity==9.2.1",
             "levenshtein==0.27.5", "rapidfuzz==3.14.6", "requests==2.34.2", "urllib3==2.8.0",
             "certifi==2026.10.19.post1", "sacrebleu==2.6.0", "portalocker==4.4.2", "tabulate==0.10.0",
             "colorama==0.4.6", "lxml==6.2.1", "opencv-python-headless==5.1.0.95")  # fmt: skip
# sacrebleu..lxml: imported by lmms_eval.api.metrics, which the task modules import through lmms_eval.tasks; OpenCV:
# Video-MME's subtitle step reads a video's frame count and rate with it.
DRIVER = Path(__file__).with_name("lmms_driver.py")


def lmms_eval_results(cases: dict, tmp: Path) -> dict:
    """``cases``: benchmark → {"docs": [...], "answers": [...]} (Video-MME's also ``hf_home``, the folder holding its
    ``videomme/``) → lmms-eval's prompts and scores for each."""
    site = cached_site("lmms-eval-0.7.3", LMMS_PINS)
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": str(site), "API_TYPE": "openai", "OPENAI_API_KEY": "none"}  # fmt: skip
    proc = subprocess.run([sys.executable, str(DRIVER), str(tmp / "cases.json"), str(tmp / "lmms.json")], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    if proc.returncode:
        pytest.fail(f"lmms-eval driver failed:\n{proc.stderr[-4000:]}")
    return json.loads((tmp / "lmms.json").read_text())
