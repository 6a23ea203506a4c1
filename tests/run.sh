#!/usr/bin/env bash
# Set up and run the mpicons test suite on a fresh machine: a virtualenv in .venv with mpicons,
# its test extras and MPICH (no system MPI needed), then the serial tests, then the MPI tests at
# 1, 2, 3 and 4 ranks. Tests marked slow run only with --run-slow (or MPICONS_SLOW=1, as CI does).
#   bash tests/run.sh              # the default run (about two minutes on two cores)
#   bash tests/run.sh --run-slow   # everything
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q -e '.[test,mpich]'
export PYTHONDONTWRITEBYTECODE=1
.venv/bin/python -m pytest -q -p no:cacheprovider "$@" tests
for ranks in 1 2 3 4; do
  echo "== MPI tests at $ranks rank(s)"
  # python -m mpi4py aborts the whole job if a rank dies with an exception (no hang); -x stops at the first failure.
  timeout 900 .venv/bin/mpiexec -n "$ranks" .venv/bin/python -m mpi4py -m pytest -q -x -p no:cacheprovider --only-mpi "$@" tests
done
