"""Every rank leaves the process group together at the end of a run, whether it finished or stopped with a checkpoint.

Without this, a rank's gloo / NCCL worker threads are still up when the interpreter shuts down, and a rank that is
torn down while it exits aborts ("terminate called without an active exception", SIGABRT, status 134). Under SLURM
that is what happens after a stop: the first rank to exit 138 makes ``srun --kill-on-bad-exit`` cancel the step, a
slower rank aborts, the step's status is 134 instead of 138, and ``scripts/slurm/launch.sh`` does not requeue the job
although its checkpoint is complete.
"""

from __future__ import annotations

import torch.distributed as dist


def leave_together() -> None:
    """A barrier (no rank exits while another still writes or tears down), then ``destroy_process_group`` while the
    interpreter is fully alive, which joins the backend's threads. Does nothing outside a process group."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
