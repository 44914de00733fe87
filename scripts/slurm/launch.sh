#!/bin/bash
# Shared body of pretrain.sbatch / finetune.sbatch: rendezvous, NCCL settings, optional container, requeue, srun.
# Sourced by the sbatch files after they set NEVA_STAGE_ARGS (Hydra arguments choosing the stage or preset).
# Everything below is overridable from the environment of `sbatch` (sbatch exports it by default).
set -euo pipefail

# --- paths ------------------------------------------------------------------------------------------------------
# sbatch runs a spooled copy of the script, so locate the checkout through the submit directory, not $0.
NEVA_ROOT=${NEVA_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
# One output root per experiment name (not per job id): a requeued or resubmitted job finds its checkpoints there,
# and finetune finds pretrain's final checkpoint at $NEVA_OUTPUT_ROOT/pretrain/final.
NEVA_EXP_NAME=${NEVA_EXP_NAME:-${SLURM_JOB_NAME:-neva}}
export NEVA_OUTPUT_ROOT=${NEVA_OUTPUT_ROOT:-$NEVA_ROOT/outputs/$NEVA_EXP_NAME}
NEVA_LOG_DIR=${NEVA_LOG_DIR:-$NEVA_OUTPUT_ROOT/logs}
mkdir -p "$NEVA_LOG_DIR"

# --- rendezvous (torch.distributed env://) ----------------------------------------------------------------------
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# A port derived from the job id: two jobs sharing a first node do not collide.
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export MASTER_ADDR MASTER_PORT
# --- devices: one task per GPU of the allocation; none allocated (a CPU cluster) → CPU, SLURM's tasks per node ------
# GPUS_PER_NODE (tasks per node; 0 = CPU) and NEVA_ACCELERATOR (gpu|cpu) override what the allocation says. GPUs that
# SLURM does not manage as GRES are counted with nvidia-smi on the first node.
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
  if [[ "${SLURM_GPUS_ON_NODE:-0}" =~ ^[1-9][0-9]*$ ]]; then
    GPUS_PER_NODE=$SLURM_GPUS_ON_NODE
  elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    GPUS_PER_NODE=$(nvidia-smi -L | grep -c '^GPU')
  else
    GPUS_PER_NODE=0
  fi
fi
if [[ "$GPUS_PER_NODE" == 0 ]]; then
  NEVA_ACCELERATOR=${NEVA_ACCELERATOR:-cpu}
  TASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-1}
else
  NEVA_ACCELERATOR=${NEVA_ACCELERATOR:-gpu}
  TASKS_PER_NODE=$GPUS_PER_NODE
fi
NNODES=${SLURM_JOB_NUM_NODES:-1}

# --- NCCL / runtime ----------------------------------------------------------------------------------------------
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# Fail fast on a hung collective instead of burning the allocation.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
# DGX: InfiniBand for inter-node traffic; GPUDirect RDMA when the NIC and GPU share a PCIe switch.
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}
# Set NCCL_SOCKET_IFNAME / NCCL_IB_HCA in the environment when the cluster needs them (site-specific).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-8}}
export PYTHONUNBUFFERED=1
# A crash in native code (abort, segfault: e.g. "terminate called …") then prints every thread's Python stack into the
# task log, which would otherwise hold one C++ line and no hint of where it happened.
export PYTHONFAULTHANDLER=${PYTHONFAULTHANDLER:-1}
export HYDRA_FULL_ERROR=1

# --- preemption: signals are forwarded to the tasks, which stop with a checkpoint; USR1 then requeues ------------------
# The sbatch headers ask for SIGUSR1 to this shell before the time limit (--signal=B:USR1@600). It is forwarded to the
# training tasks, which finish their current step, agree on it, write one checkpoint and exit 138 (128 + SIGUSR1,
# neva/training/stop_signal.py); only then, and only with that status, is the job requeued: the requeued attempt
# resumes from that checkpoint (exp_manager.resume_if_exists=true) and logs the step it resumes from. SIGTERM (scancel,
# preemption with a grace time) is forwarded the same way (SLURM also sends it to the tasks directly: a second copy
# changes nothing); the tasks exit 143 after their checkpoint and the job ends without a requeue.
STOP_SIGNAL=""
SRUN_PID=""
forward() {
  STOP_SIGNAL=${STOP_SIGNAL:-$1}
  echo "[neva] $(date -Is) SIG$1: forwarding to the training tasks (they stop after this step with a checkpoint)"
  if [[ -n "$SRUN_PID" ]]; then
    kill -"$1" "$SRUN_PID" 2>/dev/null || true
  fi
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

# --- container (pyxis/enroot), optional -----------------------------------------------------------------------------
SRUN_CONTAINER=()
if [[ -n "${NEVA_CONTAINER_IMAGE:-}" ]]; then
  MOUNTS="$NEVA_ROOT:$NEVA_ROOT,$NEVA_OUTPUT_ROOT:$NEVA_OUTPUT_ROOT${NEVA_CONTAINER_MOUNTS:+,$NEVA_CONTAINER_MOUNTS}"
  SRUN_CONTAINER=(--container-image="$NEVA_CONTAINER_IMAGE" --container-mounts="$MOUNTS" --container-workdir="$NEVA_ROOT")
fi

echo "[neva] $(date -Is) job $SLURM_JOB_ID attempt $((${SLURM_RESTART_COUNT:-0} + 1)) (restart count ${SLURM_RESTART_COUNT:-0}): $NNODES node(s) x $TASKS_PER_NODE task(s), $NEVA_ACCELERATOR, master $MASTER_ADDR:$MASTER_PORT"
echo "[neva] output root $NEVA_OUTPUT_ROOT; task logs $NEVA_LOG_DIR; image ${NEVA_CONTAINER_IMAGE:-<none: host environment>}"
echo "[neva] args: ${NEVA_STAGE_ARGS[*]} $*"

# One task per GPU (or per SLURM task on CPU); each maps SLURM's ids to the torchrun variables (task.sh). A task that
# fails (or is killed) ends the step at once (--kill-on-bad-exit); a hung collective ends at
# model.distributed_timeout_minutes. srun runs in the background so the traps fire while it runs.
srun --kill-on-bad-exit=1 --ntasks-per-node="$TASKS_PER_NODE" "${SRUN_CONTAINER[@]}" \
  --output="$NEVA_LOG_DIR/%x-%j-r${SLURM_RESTART_COUNT:-0}-%t.log" \
  bash "$NEVA_ROOT/scripts/slurm/task.sh" \
  "${NEVA_STAGE_ARGS[@]}" \
  trainer.num_nodes="$NNODES" trainer.devices="$TASKS_PER_NODE" trainer.accelerator="$NEVA_ACCELERATOR" \
  exp_manager.resume_if_exists=true \
  "$@" &
SRUN_PID=$!
# A trapped signal interrupts `wait`; wait again until srun itself has exited, and keep its status.
while true; do
  status=0
  wait "$SRUN_PID" || status=$?
  kill -0 "$SRUN_PID" 2>/dev/null || break
done
echo "[neva] $(date -Is) tasks exited with status $status"
if [[ "$STOP_SIGNAL" == USR1 && "$status" == 138 ]]; then
  echo "[neva] $(date -Is) stopped by SIGUSR1 with a checkpoint: requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
elif [[ -n "$STOP_SIGNAL" ]]; then
  echo "[neva] SIG$STOP_SIGNAL: not requeued (tasks exited with $status)"
fi
exit "$status"
