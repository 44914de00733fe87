"""Train the quality canary under deliberately injected bugs and report, per bug, where each skill lands against the
clean bands (tests/training/canary_bands.json). Not part of CI: one canary per bug.

    python scripts/canary_bugs.py                     # every bug, 2 at a time, outputs under outputs/canary_bugs
    python scripts/canary_bugs.py --bugs rope_bf16,no_splice --jobs 1 --markdown
    python scripts/canary_bugs.py --write-bands 1234,1235,1236 --measured "date, machine"   # re-measure the bands

Each bug is injected only inside this script's own child processes (``--inject BUG -m MODULE ARGS``: patch, then run
the module as ``__main__``), never through hooks in neva. The stages run exactly the canary's commands
(``+canary=pretrain``, ``+canary=finetune``, ``neva.evaluate --suite skills``); model-level bugs are
also active in the evaluation (the same code serves inference), data- and training-side bugs only while training.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BANDS = ROOT / "tests" / "training" / "canary_bands.json"
RESUME_AT = 180  # optimizer step (of 540) at which the resume bug's finetune stops (SIGUSR1) and is resumed


def _wrap_collator(edit) -> None:
    from neva.data.collate import Collator
    from neva.models.loss import learned_positions

    original = Collator.__call__

    def call(self, batch):
        out = edit(original(self, batch))
        positions, targets = learned_positions(out.labels)
        return out.with_(output_positions=positions, targets=targets)

    Collator.__call__ = call


def labels_shifted() -> None:
    """Labels one position late: every target is the token at its own position instead of the next one."""
    from neva.constants import IGNORE_INDEX

    def edit(out):
        labels = out.labels
        shifted = labels.new_full(labels.shape, IGNORE_INDEX)
        shifted[:, 1:] = labels[:, :-1]
        return out.with_(labels=shifted)

    _wrap_collator(edit)


def no_splice() -> None:
    """The image features are not spliced: zeros stand at the image positions (training and evaluation)."""
    from neva.models.neva import NevaModel

    original = NevaModel.image_features
    NevaModel.image_features = lambda self, pixels: original(self, pixels) * 0


def pixels_unnormalised() -> None:
    """The tower's mean/std normalisation skipped: pixels reach it as ``x / 255`` in [0, 1] (as with an image
    processor's ``do_normalize=False``), in training and evaluation."""
    from neva.models import vision

    vision.normalize_pixels = lambda pixels, mean, std: pixels.float().div(255.0)


def _restart_positions_off_by(shift: int) -> None:
    """Packed rows: each sample's position count restarts ``shift`` tokens off its boundary (clipped to the row)."""
    import torch

    def edit(out):
        seg = out.segment_ids
        for r in range(seg.shape[0]):
            starts = [0, *((seg[r, 1:] != seg[r, :-1]).nonzero().flatten() + 1).tolist()]
            cuts = sorted({min(max(s + shift, 0), seg.shape[1]) for s in starts if seg[r, s] > 0} | {0, seg.shape[1]})
            pos = torch.cat([torch.arange(b - a) for a, b in pairwise(cuts)])
            out.position_ids[:, r] = pos * (seg[r] > 0)
        return out

    _wrap_collator(edit)


def positions_restart_late() -> None:
    """Packed rows: positions restart 8 tokens late, inside each sample (its first 8 tokens continue the count
    before them: BOS, ` USER: ` and the first image tokens)."""
    _restart_positions_off_by(8)


def positions_restart_early() -> None:
    """Packed rows: positions restart 8 tokens early, inside the sample before each boundary (its last 8 tokens,
    ``ASSISTANT:`` and the learned reply, count from 0 again)."""
    _restart_positions_off_by(-8)


def rope_bf16() -> None:
    """RoPE inverse frequencies rounded to bf16 (the O2 bug found earlier)."""
    import torch

    from neva.models import llama, rope

    original = rope.rope_inv_freq
    llama.rope_inv_freq = lambda *a, **k: original(*a, **k).to(torch.bfloat16).float()


def loss_weights_per_micro_batch() -> None:
    """Each micro-batch's summed loss divided by its own token count, not the global batch's: per-micro-batch means
    summed over the accumulation (the step objective ×2 here, and tokens of short micro-batches weigh more)."""
    from neva.models.loss import count_learned_tokens
    from neva.training import engine

    engine.micro_batch_weight = lambda norm, labels, global_tokens, micro_batches, dp_size: (
        1.0 / (count_learned_tokens(labels).to(global_tokens.device, global_tokens.dtype).clamp(min=1.0))
    )


def stop_at_resume_step() -> None:
    """(Helper of the resume bug.) SIGUSR1 to itself after optimizer step ``RESUME_AT``: the run checkpoints at that
    step boundary and exits 138, as under SLURM's time-limit warning."""
    from neva.training import engine

    original, steps = engine.Engine.after_optimizer_step, [0]

    def after(self):
        original(self)
        steps[0] += 1
        if steps[0] == RESUME_AT:
            os.kill(os.getpid(), signal.SIGUSR1)

    engine.Engine.after_optimizer_step = after


def drop_optimizer_state() -> None:
    """A resume that loads the weights but drops the optimizer state (fresh AdamW moments). neva's resume copies the
    saved state into the optimizer by parameter name (``neva.parallel.strategy``), never through
    ``Optimizer.load_state_dict``, so the saved state is emptied as the checkpoint file is read (patching
    ``load_state_dict`` changed nothing: bitwise the clean result, measured 2026-12-01)."""
    from neva.checkpoint import verified

    original = verified.load_state

    def load_state(path):
        checkpoint = original(path)
        for saved in checkpoint.get("optimizer_states", []):
            saved["state"] = {}
        return checkpoint

    verified.load_state = load_state


INJECTIONS = {
    f.__name__: f
    for f in (
        labels_shifted,
        no_splice,
        pixels_unnormalised,
        positions_restart_late,
        positions_restart_early,
        rope_bf16,
        loss_weights_per_micro_batch,
        stop_at_resume_step,
        drop_optimizer_state,
    )
}
# bug → (injections while training pretrain + finetune, injections while evaluating, extra finetune overrides)
BUGS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "clean": ((), (), ()),
    "labels_shifted": (("labels_shifted",), (), ()),
    "no_splice": (("no_splice",), ("no_splice",), ()),
    "pixels_unnormalised": (("pixels_unnormalised",), ("pixels_unnormalised",), ()),
    "positions_restart_late": (("positions_restart_late",), (), ()),
    "projector_frozen_in_finetune": ((), (), ("model.mm_cfg.freeze_projector=true",)),
    "positions_restart_early": (("positions_restart_early",), (), ()),
    "rope_bf16": (("rope_bf16",), ("rope_bf16",), ()),
    # The O2 incident as it was: rounded by training's cast only, fp32 in the evaluation (and an HF export).
    "rope_bf16_in_training": (("rope_bf16",), (), ()),
    "resume_drops_optimizer_state": ((), (), ()),  # finetune stopped at RESUME_AT, resumed with drop_optimizer_state
    "loss_weights_per_micro_batch": (("loss_weights_per_micro_batch",), (), ()),
}


def _child(inject: list[str], module: str, args: list[str]) -> None:
    for name in inject:
        INJECTIONS[name]()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _run(inject: tuple[str, ...], module: str, args: list[str], env: dict[str, str], log: Path, ok=(0,)) -> str:
    cmd = [sys.executable, __file__, "--inject", ",".join(inject), "-m", module, *args]
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=f, text=True, cwd=ROOT)
        f.write(proc.stdout)
    if proc.returncode not in ok:
        raise RuntimeError(f"{module} exited {proc.returncode} (see {log})")
    return proc.stdout


def run_bug(bug: str, out_root: Path, seed: int | None = None) -> dict:
    """Train and evaluate the canary under ``bug`` (``seed``: the run's ``model.seed``, default the recipe's); the
    evaluation's JSON."""
    train_inject, eval_inject, finetune_extra = BUGS[bug]
    root = out_root / (bug if seed is None else f"{bug}-seed{seed}")
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "NEVA_OUTPUT_ROOT": str(root), "PYTHONPATH": str(ROOT)}
    log = root / "log.txt"
    common = ["trainer.enable_progress_bar=false", *([] if seed is None else [f"++model.seed={seed}"])]
    _run(train_inject, "neva.train", ["+canary=pretrain", *common], env, log)
    finetune = ["+canary=finetune", *common, *finetune_extra]
    if bug == "resume_drops_optimizer_state":
        _run(("stop_at_resume_step",), "neva.train", finetune, env, log, ok=(138,))
        _run(("drop_optimizer_state",), "neva.train", finetune, env, log)
    else:
        _run(train_inject, "neva.train", finetune, env, log)
    checkpoint = root / "canary" / "finetune" / "final"
    out = _run(eval_inject, "neva.evaluate", ["--suite", "skills", "--checkpoint", str(checkpoint)], env, log)
    return json.loads(out.strip().splitlines()[-1])


def bands_from(results: list[dict], measured: str) -> dict:
    """Bands over clean results: [min - margin, max + margin] per skill and metric, clipped to [0, 1]. The margin is
    0.03 (0.02 for the whole suite), and for an accuracy at least two standard errors of a proportion at the band's
    centre over the questions asked: another trajectory re-draws which questions a skill near chance gets right
    (``binding`` at 0.31 over 200 questions: ±0.065)."""
    from neva.evaluate import BAND_METRICS  # not at the top: an --inject child patches neva before importing it

    def band(values: list[float], margin: float, n: int | None) -> list[float]:
        if n is not None:
            centre = (min(values) + max(values)) / 2
            margin = max(margin, 2 * math.sqrt(centre * (1 - centre) / n))
        return [round(max(0.0, min(values) - margin), 4), round(min(1.0, max(values) + margin), 4)]

    def bands(rows: list[dict], margin: float) -> dict:
        return {m: band([r[m] for r in rows], margin, rows[0]["n"] if m == "accuracy" else None) for m in BAND_METRICS}

    return {
        "measured": measured,
        "n": results[0]["n"],
        "overall": bands(results, 0.02),
        "skills": {k: bands([r["skills"][k] for r in results], 0.03) for k in results[0]["skills"]},
    }


def markdown(results: dict[str, dict], bands: dict) -> str:
    """The table for docs/TRAINING.md: accuracy / reply probability per skill, bold outside the band."""
    from neva.evaluate import BAND_METRICS, outside_bands

    names = ["overall", *bands["skills"]]
    lines = ["| bug | " + " | ".join(names) + " | caught (outside the band) |", "|" + "---|" * (len(names) + 2)]
    limits = {"overall": bands["overall"], **bands["skills"]}
    cells = [" / ".join(f"{lo:.3f}–{hi:.3f}" for lo, hi in (limits[k][m] for m in BAND_METRICS)) for k in names]
    lines.append("| clean band | " + " | ".join(cells) + " | |")
    for bug, result in results.items():
        if "error" in result:
            lines.append(f"| {bug} | " + " | ".join("–" for _ in names) + f" | run failed: {result['error']} |")
            continue
        outside = outside_bands(result, bands)
        values = {"overall": result, **result["skills"]}
        cells = [
            " / ".join(
                f"**{values[k][m]:.3f}**" if f"{k} {m}" in outside else f"{values[k][m]:.3f}" for m in BAND_METRICS
            )
            for k in names
        ]
        caught = "yes: " + ", ".join(outside) if outside else "no"
        lines.append(f"| {bug} | " + " | ".join(cells) + f" | {caught} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--inject":
        inject = [n for n in sys.argv[2].split(",") if n]
        assert sys.argv[3] == "-m"
        _child(inject, sys.argv[4], sys.argv[5:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bugs", default=",".join(BUGS), help=f"comma-separated, of: {', '.join(BUGS)}")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "canary_bugs")
    parser.add_argument("--jobs", type=int, default=2, help="canaries trained at once")
    parser.add_argument("--markdown", action="store_true", help="also print the table for docs/TRAINING.md")
    parser.add_argument(
        "--write-bands",
        metavar="SEEDS",
        help="instead of bugs: train the clean canary with each comma-separated model.seed and write the bands over "
        f"them to {BANDS.relative_to(ROOT)} (the machine and date go into its 'measured' field: pass --measured)",
    )
    parser.add_argument("--measured", default="", help="with --write-bands: when, where and how the bands were run")
    args = parser.parse_args()
    from neva.evaluate import outside_bands

    if args.write_bands:
        seeds = [int(s) for s in args.write_bands.split(",") if s]
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda seed: run_bug("clean", args.out, seed), seeds))
        for seed, result in zip(seeds, results):
            print(json.dumps({"seed": seed, **result}), flush=True)
        BANDS.write_text(json.dumps(bands_from(results, args.measured), indent=2) + "\n")
        return
    bugs = [b for b in args.bugs.split(",") if b]
    unknown = [b for b in bugs if b not in BUGS]
    if unknown:
        sys.exit(f"unknown bug(s) {unknown}; choose from {list(BUGS)}")
    bands = json.loads(BANDS.read_text())

    def one(bug: str) -> tuple[str, dict]:
        try:
            return bug, run_bug(bug, args.out)
        except RuntimeError as err:
            return bug, {"error": str(err)}

    results = {}
    with ThreadPoolExecutor(args.jobs) as pool:
        for bug, result in pool.map(one, bugs):
            results[bug] = result
            if "error" not in result:
                result["outside_band"] = outside_bands(result, bands)
            print(json.dumps({"bug": bug, **result}), flush=True)
    if args.markdown:
        print(markdown(results, bands))


if __name__ == "__main__":
    main()
