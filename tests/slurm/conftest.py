"""One real two-node SLURM cluster per test session (scripts/slurm/local_cluster.sh), and helpers to submit the
repository's sbatch scripts to it and follow their jobs."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.training.conftest import LEAN

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm" / "local_cluster.sh"
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
# Two nodes with one CPU task each; the lean tiny default with micro-batches of 8 (global batch 32: 2 accumulation
# steps per rank, as 4 in one process).
NODES = ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1"]
TRAIN = [*LEAN, "model.micro_batch_size=8", "trainer.log_every_n_steps=1"]


@dataclass
class Cluster:
    conf: Path

    def env(self, output_root: Path) -> dict[str, str]:
        """What sbatch exports to the job: this interpreter's environment first on PATH (task.sh runs `python`)."""
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return {
            **os.environ, "PATH": path, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1",
            "SLURM_CONF": str(self.conf), "NEVA_OUTPUT_ROOT": str(output_root), "NEVA_ROOT": str(REPO),
        }  # fmt: skip

    def submit(self, script: str, output_root: Path, *overrides: str, sbatch: tuple[str, ...] = ()) -> str:
        """``sbatch`` a script of scripts/slurm from the repository root; returns the job id."""
        out = output_root / "batch-%j.out"
        cmd = ["sbatch", "--parsable", *NODES, f"--output={out}", *sbatch, f"scripts/slurm/{script}", *overrides]
        done = subprocess.run(cmd, cwd=REPO, env=self.env(output_root), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def show(self, job: str) -> dict[str, str]:
        out = subprocess.run(
            ["scontrol", "-o", "show", "job", job], env=self.env(Path("/")), capture_output=True, text=True, timeout=60
        ).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job: str, until: set[str] | None = None, timeout: float = 600) -> dict[str, str]:
        """Poll the job until its state is in ``until`` (default: any final state).

        A requeued job is released early from the two minutes SLURM holds it, but not at once: slurmd refuses a
        job whose credential was issued in the same second as the previous attempt's revocation ("Killing
        non-startable batch job: Job credential revoked", the job ends FAILED). ``now+3`` (seconds) clears that second.
        """
        until = until or DONE
        deadline = time.time() + timeout
        released = set()  # restart counts whose hold was shortened (once each: a repeat would push the start back)
        while time.time() < deadline:
            info = self.show(job)
            if info.get("JobState") in until:
                return info
            held = info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime"
            if held and info.get("Restarts") not in released:
                released.add(info.get("Restarts"))
                subprocess.run(
                    ["scontrol", "update", f"JobId={job}", "StartTime=now+3"], env=self.env(Path("/")), timeout=60
                )
            time.sleep(0.5)
        subprocess.run(["scancel", job], env=self.env(Path("/")), timeout=60)
        raise AssertionError(f"job {job} still {self.show(job).get('JobState')} after {timeout} s")


@pytest.fixture(scope="session")
def slurm() -> Cluster:
    if os.geteuid() != 0:
        pytest.skip("a local SLURM cluster needs root (daemons, /etc/hosts): scripts/slurm/local_cluster.sh")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        pytest.skip("SLURM is not installed and there is no apt-get to install it")
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=900)
    if done.returncode == 3:
        pytest.skip(f"no local SLURM cluster on this machine: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stdout + done.stderr
    return Cluster(Path(os.environ.get("NEVA_SLURM_DIR", "/var/tmp/neva-slurm")) / "slurm.conf")


def read_losses(exp_dir: Path) -> dict[int, float]:
    with open(exp_dir / "metrics.csv") as f:
        return {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")}


def wait_for_steps(exp_dir: Path, steps: int, cluster: Cluster, job: str, timeout: float = 600) -> None:
    """Poll metrics.csv until ``steps`` steps are logged (the job must still be running)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (exp_dir / "metrics.csv").exists() and max(read_losses(exp_dir), default=0) >= steps:
            return
        assert cluster.show(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), cluster.show(job)
        time.sleep(0.1)
    raise AssertionError(f"{exp_dir}: fewer than {steps} steps after {timeout} s")


def task_log(output_root: Path, job: str, restart: int, task: int, name: str = "neva-pretrain") -> str:
    return (output_root / "logs" / f"{name}-{job}-r{restart}-{task}.log").read_text()


def job_report(output_root: Path, job: str) -> str:
    """The end of the job's batch output and of every task log of every attempt: what a failed assertion shows."""
    files = [output_root / f"batch-{job}.out", *sorted((output_root / "logs").glob(f"*-{job}-r*-*.log"))]
    return "\n".join(f"--- {f.name}\n{f.read_text()[-2000:]}" for f in files if f.exists())
