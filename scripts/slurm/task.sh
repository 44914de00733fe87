#!/bin/bash
# One training process per GPU, started by srun: SLURM's ids become the torchrun/env:// variables neva reads.
set -euo pipefail
export RANK=$SLURM_PROCID
export WORLD_SIZE=$SLURM_NTASKS
export LOCAL_RANK=$SLURM_LOCALID
export LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE
export NODE_RANK=$SLURM_NODEID
# Activate a virtual environment when the job runs on the host rather than in the container.
if [[ -n "${NEVA_VENV:-}" ]]; then
  # shellcheck disable=SC1091
  source "$NEVA_VENV/bin/activate"
fi
exec python -m neva.train "$@"
