#!/usr/bin/env bash
# Set up and run the mpicons test suite on a fresh machine: a virtualenv in .venv with mpicons,
# its test extras and MPICH (no system MPI needed); lint and type checks; the serial tests; then
# the MPI tests at 1, 2, 3 and 4 ranks. Tests marked slow run only with --run-slow (or
# MPICONS_SLOW=1, as CI does).
#   bash tests/run.sh              # the default run (about two minutes on two cores)
#   bash tests/run.sh --run-slow   # everything
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q -e '.[test,mpich]'
export PYTHONDONTWRITEBYTECODE=1 RUFF_CACHE_DIR=.venv/.ruff-cache MYPY_CACHE_DIR=.venv/.mypy-cache
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

echo "== lint (ruff) and types (mypy)"
.venv/bin/ruff check -q mpicons tests benchmarks
.venv/bin/ruff format -q --check mpicons tests benchmarks
.venv/bin/mypy mpicons | tee "$logs/types"

echo "== serial tests"
.venv/bin/python -m pytest -q -p no:cacheprovider "$@" tests | tee "$logs/serial"

# Rank 0 reports; the other ranks' output goes to files, shown only if the run fails.
# pytest-mpi prints an "MPI Information" block per rank; drop it, keep everything else.
without_banners() { awk '/=+ MPI Information =+/ {skip = 1} !skip {print} /^mpi4py config:/ {skip = 0}'; }
for ranks in 1 2 3 4; do
  echo "== MPI tests at $ranks rank(s)"
  rm -f "$logs"/rank-*
  # python -m mpi4py aborts the whole job if a rank dies with an exception (no hang); -x stops at the first failure.
  status=0
  timeout 900 .venv/bin/mpiexec -n "$ranks" bash -c '
    rank=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}
    if [ "$rank" = 0 ]; then exec "${@:2}"; else exec "${@:2}" >"$1/rank-$rank" 2>&1; fi' \
    _ "$logs" .venv/bin/python -m mpi4py -m pytest -q -x -p no:cacheprovider --only-mpi "$@" tests \
    | without_banners | tee "$logs/mpi-$ranks" || status=$?
  if [ "$status" != 0 ]; then
    for log in "$logs"/rank-*; do [ -e "$log" ] && { echo "== output of ${log##*/}"; without_banners <"$log"; }; done
    exit "$status"
  fi
done

echo "== summary"
summary() { grep -E '^[0-9]+ (passed|failed|skipped)' "$1" | head -n 1; }
printf '%-20s %s\n' "types" "$(tail -n 1 "$logs/types")" "serial" "$(summary "$logs/serial")"
for ranks in 1 2 3 4; do
  printf '%-20s %s\n' "MPI at $ranks rank(s)" "$(summary "$logs/mpi-$ranks")"
done
