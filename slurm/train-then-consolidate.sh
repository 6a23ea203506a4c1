#!/usr/bin/env bash
# train-then-consolidate.sh: submit a training job, then the consolidation as a dependent job.
#
# Usage:
#   slurm/train-then-consolidate.sh TRAIN_SBATCH CHECKPOINT_DIR OUTPUT_DIR [mpicons options...]
#   e.g. slurm/train-then-consolidate.sh train.sbatch /scratch/run42/checkpoint/step-10000 /scratch/run42/hf
#
# The consolidation starts only if training ends successfully (afterok); if training fails, the
# dependent job is cancelled rather than left pending forever (--kill-on-invalid-dep=yes).
# Environment: as for consolidate.sbatch (MPICONS_VENV, MPICONS_LAUNCH, MPICONS_PROGRESS_EVERY,
# MPICONS_PROGRESS); CONSOLIDATE_SBATCH_ARGS adds sbatch options for the consolidation job
# (e.g. "--nodes=2 --time=30").
#
# Nothing is submitted until the settings, paths and mpicons options have passed consolidate.sbatch's
# own checks (run here, now): a mistake shows up at once, not after the training has run.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 TRAIN_SBATCH CHECKPOINT_DIR OUTPUT_DIR [mpicons options...]" >&2
  exit 2
fi
train_script=$1
checkpoint_dir=$2
output_dir=$3
shift 3
here=$(cd "$(dirname "$0")" && pwd)

if [ ! -f "$train_script" ] || [ ! -r "$train_script" ]; then
  echo "mpicons: TRAIN_SBATCH $train_script is not a readable file" >&2
  exit 2
fi
if ! command -v sbatch >/dev/null 2>&1; then
  echo "mpicons: sbatch not found: run this on a machine that submits Slurm jobs" >&2
  exit 2
fi
bash "$here/consolidate.sbatch" --check "$checkpoint_dir" "$output_dir" "$@"

train_job=$(sbatch --parsable "$train_script")
echo "training job: $train_job"
# shellcheck disable=SC2086  # extra sbatch options are split on purpose
consolidate_job=$(sbatch --parsable --dependency="afterok:$train_job" --kill-on-invalid-dep=yes \
  ${CONSOLIDATE_SBATCH_ARGS:-} "$here/consolidate.sbatch" "$checkpoint_dir" "$output_dir" "$@")
echo "consolidation job: $consolidate_job (runs after $train_job succeeds)"
