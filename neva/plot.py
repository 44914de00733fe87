"""``python -m neva.plot EXP_DIR [--out FILE]``: loss curves of a run (``metrics.csv``) as a PNG.

Writes ``EXP_DIR/loss.png`` by default and prints its path.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path


def read_series(metrics: Path, key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    with open(metrics, newline="") as f:
        for row in csv.DictReader(f):
            if row.get(key):
                steps.append(int(float(row["step"])))
                values.append(float(row[key]))
    return steps, values


def plot(exp_dir: Path, out: Path | None = None) -> Path:
    """Train (and validation, when logged) loss against step."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    metrics = exp_dir / "metrics.csv"
    if not metrics.exists():
        raise FileNotFoundError(f"no metrics.csv in {exp_dir}")
    out = out or exp_dir / "loss.png"
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for key, style in (("train_loss", "-"), ("val_loss", "o--")):
        steps, values = read_series(metrics, key)
        if steps:
            ax.plot(steps, values, style, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / learned token)")
    ax.set_title(str(exp_dir))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exp_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        print(plot(args.exp_dir, args.out))
    except FileNotFoundError as err:
        sys.exit(str(err))


if __name__ == "__main__":
    main()
