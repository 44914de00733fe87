"""``model.distributed_timeout_minutes``: a rank that stops answering ends the run within the timeout, and the error
names the rank and the collective (real gloo processes, real signals)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from neva.config import compose_config
from neva.typed import ConfigError

from .harness import free_port


def test_timeout_must_be_positive():
    assert compose_config(["+stage=pretrain"]).model.distributed_timeout_minutes == 10  # Megatron-LM's default
    with pytest.raises(ConfigError, match="distributed_timeout_minutes must be > 0"):
        compose_config(["+stage=pretrain", "model.distributed_timeout_minutes=0"])


def test_only_distributed_timeouts_get_a_note():
    from neva.parallel.collective_timeout import timeout_note

    def fail(err):
        try:
            raise err
        except Exception as caught:
            return caught

    minute = timedelta(minutes=1)
    assert timeout_note(fail(RuntimeError("shape mismatch")), minute, 0) is None
    # A timeout that is not torch.distributed's (no torch.distributed frame, no backend wording): no note.
    assert timeout_note(fail(RuntimeError("DataLoader timed out after 5 seconds")), minute, 0) is None
    gloo = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 60000ms for recv operation"
    note = timeout_note(fail(RuntimeError(gloo)), minute, 1)
    assert note.startswith("rank 1: a collective timed out after 60 s (model.distributed_timeout_minutes=1)"), note


MESH_TIMEOUT_S = 5.0


def _mesh_worker(rank: int, port: int, out: str) -> None:
    """4 ranks, mesh (pp 1, dp 2, tp 2): rank 0 all-reduces over its tp group {0, 1} and rank 3 over its dp group
    {1, 3}; rank 1 joins neither. Both are sub-groups that ``init_device_mesh`` creates itself, so they time out
    after the run's timeout only if ``build_mesh`` passes it on (torch's default would be 30 minutes)."""
    import torch
    import torch.distributed as dist

    from neva.parallel.collective_timeout import timeout_note
    from neva.parallel.layout import Layout
    from neva.parallel.mesh import build_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    Path(out, f"pid{rank}").write_text(str(os.getpid()))
    timeout = timedelta(seconds=MESH_TIMEOUT_S)
    # The default group keeps a start-up's worth of time (4 processes importing torch on a loaded machine): the
    # sub-groups' timeout can then only come from ``build_mesh``.
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=timedelta(minutes=5))
    layout = Layout(dp=2, tp=2)
    dims = build_mesh(layout, timeout)
    result_file = Path(out, f"rank{rank}.json")
    if rank in (0, 3):
        group = dims.group("tp" if rank == 0 else "dp")
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4), group=group)
            result = {"error": None}
        except RuntimeError as err:
            result = {"error": str(err), "note": timeout_note(err, timeout, rank, layout)}
        result["elapsed"] = time.monotonic() - start
        result_file.write_text(json.dumps(result))
        # Leave without tearing the groups down: gloo's worker thread is still inside the timed-out receive, and
        # destroying it at interpreter exit can std::terminate the process ("terminate called without an active
        # exception", SIGABRT) — seen once in CI on a loaded machine.
        os._exit(0)
    else:
        # Stay alive (sockets open, like a hung peer) until both waiting ranks have given up and exited: a peer
        # that closes its sockets earlier ends their wait for another reason, or — while a rank with a timed-out
        # receive still tears down its group — makes gloo's transport thread abort that rank (SIGABRT).
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not all(_ended(out, r) for r in (0, 3)):
            time.sleep(0.1)


def _ended(out: str, rank: int) -> bool:
    """Whether ``rank`` wrote its result and its process has exited (gone, or a zombie its parent has not reaped)."""
    if not Path(out, f"rank{rank}.json").exists():
        return False
    try:
        stat = Path(f"/proc/{Path(out, f'pid{rank}').read_text()}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.slow
def test_mesh_sub_groups_time_out_after_the_configured_timeout(tmp_path):
    # forked from the harness's server (torch and neva imported once for the session), not 4 fresh interpreters
    mp.start_processes(_mesh_worker, args=(free_port(), str(tmp_path)), nprocs=4, join=True, start_method="forkserver")
    for rank, dim_peer in ((0, "pp 0, dp 0, tp 0"), (3, "pp 0, dp 1, tp 1")):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["error"] is not None, "the collective should have failed"
        assert "Timed out" in result["error"], result["error"]
        # The timeout is 5 s; generous slack for a loaded machine, far below torch's default of 30 minutes.
        assert MESH_TIMEOUT_S * 0.5 <= result["elapsed"] < 60, result
        assert result["note"].startswith(f"rank {rank} ({dim_peer}): torch.distributed all_reduce"), result["note"]
        assert "timed out after 5 s (model.distributed_timeout_minutes=0.0833333)" in result["note"], result["note"]


TIMEOUT_MIN = 0.3  # 18 s: long enough that the two processes' start-up never trips it on a loaded machine

E2E = [
    "+stage=pretrain",
    "trainer.max_steps=100000",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "trainer.val_check_interval=100000",
    "exp_manager.create_tensorboard_logger=false",
    "exp_manager.checkpoint_callback_params.every_n_train_steps=100000",
    "model.micro_batch_size=2",
    "model.global_batch_size=4",
    "++model.data.synthetic_train_samples=64",
    "++model.data.pad_to_multiple_of=16",
    "++model.mm_cfg.llm.arch_overrides={num_layers:2}",
    f"model.distributed_timeout_minutes={TIMEOUT_MIN}",
]


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _worker_pid(launcher: int, rank: int) -> int | None:
    for pid in _children(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


def _pending(pid: int, sig: signal.Signals) -> bool:
    """Whether ``sig`` is pending for process ``pid`` (sent to it, not yet acted on: /proc's shared pending mask)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    (mask,) = [line.split()[1] for line in status.splitlines() if line.startswith("ShdPnd:")]
    return bool(int(mask, 16) >> (sig - 1) & 1)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the worker processes through /proc")
def test_a_stopped_rank_ends_the_run_within_the_timeout(tmp_path):
    """``torchrun`` with 2 processes (DP2, FSDP2); once training runs, rank 1 gets SIGSTOP — alive, sockets open,
    silent, like a hung or wedged process. Rank 0's next collective times out after 18 s and the job exits non-zero,
    naming the rank, the call and the timeout. torchrun stops the job once rank 0 has failed: SIGTERM to the ranks
    left, then SIGKILL to those still there after a 30 s grace (fixed in torch's agent: ``_stop_workers`` ignores
    ``--shutdown-timeout``). A stopped rank cannot act on the SIGTERM, so it stays pending: the test waits until it
    sees it pending (torchrun's stop has begun) and then sends that SIGKILL itself instead of waiting out the grace
    (~30 s of CI time; the job's end, status and output are what the grace would have led to)."""
    env = {**os.environ, "NEVA_OUTPUT_ROOT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "neva.train", *E2E]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    metrics = tmp_path / "pretrain" / "metrics.csv"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:  # a step has run
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert metrics.exists(), "training did not start within 300 s"
        worker = _worker_pid(proc.pid, rank=1)
        assert worker is not None
        os.kill(worker, signal.SIGSTOP)
        stopped = time.monotonic()
        while time.monotonic() - stopped < 180 and proc.poll() is None and not _pending(worker, signal.SIGTERM):
            time.sleep(0.2)
        stopped_by_torchrun = _pending(worker, signal.SIGTERM)
        if stopped_by_torchrun:
            os.kill(worker, signal.SIGKILL)  # the end of torchrun's grace, without the 30 s
        output, _ = proc.communicate(timeout=180)
        ended = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, output[-4000:]
    assert stopped_by_torchrun, ("torchrun never began stopping the job", output[-4000:])
    # timeout (18 s) + torchrun noticing rank 0's exit, with generous slack
    assert ended < 120, (ended, output[-4000:])
    assert "Timed out waiting 18000ms" in output, output[-4000:]
    assert "rank 0 (pp 0, dp 0, tp 0): torch.distributed " in output, output[-4000:]
    assert "timed out after 18 s (model.distributed_timeout_minutes=0.3)" in output, output[-4000:]
