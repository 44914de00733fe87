"""``model.eval`` through the Lightning run: the scores of each evaluation step in ``metrics.csv`` and TensorBoard at
that step (and no other), the answers and scores under ``<exp_dir>/eval/step=N/<bench>/``."""

import csv
import json
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from neva.training.run import run
from neva.training_eval import in_training_eval
from tests.benchmarks.test_pope import make_pope


def test_scores_reach_metrics_and_tensorboard(lean_cfg, tmp_path):
    make_pope(tmp_path / "data")
    cfg = lean_cfg(
        "trainer.max_steps=3",
        "trainer.log_every_n_steps=1",
        "model.micro_batch_size=4",
        "model.global_batch_size=4",
        "exp_manager.create_tensorboard_logger=true",
        "model.eval.every_n_steps=2",
        f"model.eval.suites=[{{name:pope,data_dir:'{tmp_path / 'data'}',limit:3,max_new_tokens:2}}]",
    )
    run(cfg, evaluation=in_training_eval(cfg))
    exp = Path(cfg.exp_manager.exp_dir)
    with open(exp / "metrics.csv") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f)}
    assert [s for s, r in rows.items() if r.get("eval/pope/mean_accuracy")] == [2]
    scores = json.loads((exp / "eval" / "step=2" / "pope" / "scores.json").read_text())
    assert float(rows[2]["eval/pope/mean_f1"]) == scores["mean_f1"] and scores["questions"] == 3
    assert float(rows[2]["eval/pope/splits/adversarial/accuracy"]) == scores["splits"]["adversarial"]["accuracy"]
    answers = (exp / "eval" / "step=2" / "pope" / "answers.jsonl").read_text().splitlines()
    assert [json.loads(a)["model_id"] for a in answers] == ["step=2"] * 3
    events = EventAccumulator(str(exp / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/pope/mean_f1")] == [(2, scores["mean_f1"])]
