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
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
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
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export PYTHONUNBUFFERED=1
export HYDRA_FULL_ERROR=1

# --- requeue ------------------------------------------------------------------------------------------------------
# The sbatch headers ask for SIGUSR1 to this shell before the time limit (--signal=B:USR1@...). We requeue the job;
# on restart, exp_manager.resume_if_exists=true resumes from the last checkpoint in exp_dir.
requeue() {
  echo "[neva] $(date -Is) SIGUSR1: requeueing job $SLURM_JOB_ID (restart count ${SLURM_RESTART_COUNT:-0})"
  scontrol requeue "$SLURM_JOB_ID"
}
trap requeue USR1

# --- container (pyxis/enroot), optional -----------------------------------------------------------------------------
SRUN_CONTAINER=()
if [[ -n "${NEVA_CONTAINER_IMAGE:-}" ]]; then
  MOUNTS="$NEVA_ROOT:$NEVA_ROOT,$NEVA_OUTPUT_ROOT:$NEVA_OUTPUT_ROOT${NEVA_CONTAINER_MOUNTS:+,$NEVA_CONTAINER_MOUNTS}"
  SRUN_CONTAINER=(--container-image="$NEVA_CONTAINER_IMAGE" --container-mounts="$MOUNTS" --container-workdir="$NEVA_ROOT")
fi

echo "[neva] job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: $NNODES node(s) x $GPUS_PER_NODE GPU(s), master $MASTER_ADDR:$MASTER_PORT"
echo "[neva] output root $NEVA_OUTPUT_ROOT; image ${NEVA_CONTAINER_IMAGE:-<none: host environment>}"
echo "[neva] args: ${NEVA_STAGE_ARGS[*]} $*"

# One task per GPU; each task maps SLURM's ids to the torchrun variables (task.sh). srun runs in the background so
# the USR1 trap fires while it runs.
srun --kill-on-bad-exit=1 --ntasks-per-node="$GPUS_PER_NODE" "${SRUN_CONTAINER[@]}" \
  --output="$NEVA_LOG_DIR/%x-%j-r${SLURM_RESTART_COUNT:-0}-%t.log" \
  bash "$NEVA_ROOT/scripts/slurm/task.sh" \
  "${NEVA_STAGE_ARGS[@]}" \
  trainer.num_nodes="$NNODES" trainer.devices="$GPUS_PER_NODE" trainer.accelerator=gpu \
  exp_manager.resume_if_exists=true \
  "$@" &
wait $!
