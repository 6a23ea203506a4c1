#!/usr/bin/env bash
# Set up and run the mpicons test suite on a fresh machine: a virtualenv in .venv with mpicons,
# its test extras and MPICH (no system MPI needed); lint and type checks; the serial tests; then
# the MPI tests at 1, 2, 3 and 4 ranks; the torch.distributed tests under torchrun (2 processes;
# 1 to 4 with slow tests). Tests marked slow run only with --run-slow (or MPICONS_SLOW=1, as CI
# does). torch (version MPICONS_TORCH, default 2.13.0) is installed into .venv for the torchrun
# tests unless one is there, and with it transformers 5.24.0 (for the tests that load adapter
# output as a model) unless that imports; MPICONS_TORCH=none installs neither and skips the torchrun
# tests (tests needing transformers skip themselves when it is missing). With slow tests and torch,
# DeepSpeed 0.19.8 as well (its own converter read against mpicons' ZeRO sample).
#   bash tests/run.sh              # the default run: about nine minutes on two cores once installed
#                                  # (serial 4.2, the four MPI passes 4.4, torchrun 0.25)
#   bash tests/run.sh --run-slow   # everything: much longer (the slow tests are the large and
#                                  # failure-injection runs)
# The MPI and torch passes select their own tests (-m), so the tests they do not run are left out
# of their output instead of printed as a line of skips.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q -e '.[test,mpich]'
TORCH=${MPICONS_TORCH:-2.13.0}
if [ "$TORCH" != none ] && ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==$TORCH"
fi
if [ "$TORCH" != none ] && ! .venv/bin/python -c 'import transformers' 2>/dev/null; then
  .venv/bin/python -m pip install -q "transformers==5.24.0"
fi
slow=0
[ "${MPICONS_SLOW:-}" = 1 ] && slow=1
for arg in "$@"; do [ "$arg" = --run-slow ] && slow=1; done
# With slow tests and torch: DeepSpeed too (pure Python, its ops built only when used: about 15 s), for
# the test that runs DeepSpeed's own zero_to_fp32.py on mpicons' ZeRO-3 sample.
if [ "$slow" = 1 ] && [ "$TORCH" != none ] && ! .venv/bin/python -c 'import deepspeed' 2>/dev/null; then
  .venv/bin/python -m pip install -q "deepspeed==0.19.8"
fi
# mpicons' byte code, written once: the tests start hundreds of mpicons processes, each of which
# would otherwise compile the package again (about 0.25 s each); nothing else writes any.
.venv/bin/python -m compileall -q mpicons
export PYTHONDONTWRITEBYTECODE=1 RUFF_CACHE_DIR=.venv/.ruff-cache MYPY_CACHE_DIR=.venv/.mypy-cache
logs=$(mktemp -d)
s3_pid=
stop_s3() {
  if [ -n "$s3_pid" ]; then kill "$s3_pid" 2>/dev/null || true; wait "$s3_pid" 2>/dev/null || true; fi
  s3_pid=
}
trap 'stop_s3; rm -rf "$logs"' EXIT

echo "== lint (ruff) and types (mypy)"
.venv/bin/ruff check -q mpicons tests benchmarks
.venv/bin/ruff format -q --check mpicons tests benchmarks
.venv/bin/mypy mpicons | tee "$logs/types"

# One local S3 server (moto, loopback only) for every pass: the S3 tests reach it by this URL, with
# dummy credentials; it stops at exit (and by itself if this script is gone).
echo "== S3 test server"
.venv/bin/python tests/s3server.py serve >"$logs/s3-url" 2>"$logs/s3-log" &
s3_pid=$!
for _ in $(seq 600); do
  grep -q '^http://' "$logs/s3-url" 2>/dev/null && break
  kill -0 "$s3_pid" 2>/dev/null || break
  sleep 0.1
done
grep -q '^http://' "$logs/s3-url" || { echo "the S3 test server did not start:"; cat "$logs/s3-log"; exit 1; }
MPICONS_TEST_S3_ENDPOINT=$(head -n 1 "$logs/s3-url")
export MPICONS_TEST_S3_ENDPOINT AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_DEFAULT_REGION=us-east-1
echo "$MPICONS_TEST_S3_ENDPOINT"

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
    _ "$logs" .venv/bin/python -m mpi4py -m pytest -q -x -p no:cacheprovider --only-mpi -m mpi "$@" tests \
    | without_banners | tee "$logs/mpi-$ranks" || status=$?
  if [ "$status" != 0 ]; then
    for log in "$logs"/rank-*; do [ -e "$log" ] && { echo "== output of ${log##*/}"; without_banners <"$log"; }; done
    exit "$status"
  fi
done

# torchrun --standalone rendezvouses on a free port of its own choosing, so runs never collide.
torch_sizes=()
if [ "$TORCH" != none ]; then
  if [ "$slow" = 1 ]; then torch_sizes=(1 2 3 4); else torch_sizes=(2); fi
fi
for procs in "${torch_sizes[@]}"; do
  echo "== torch.distributed tests at $procs process(es)"
  status=0
  # Every process's output goes to a log file: rank 0's is shown, the others' only on failure.
  OMP_NUM_THREADS=1 timeout 900 .venv/bin/torchrun --standalone --nproc-per-node "$procs" --log-dir "$logs/torch-logs-$procs" \
    --redirects 3 -m pytest -q -x -p no:cacheprovider --only-torch -m torch_dist "$@" tests/test_torch.py tests/test_torch_dropin.py \
    >"$logs/torchrun-$procs" 2>&1 || status=$?
  find "$logs/torch-logs-$procs" -path '*/0/stdout.log' -exec cat {} + | tee "$logs/torch-$procs"
  if [ "$status" != 0 ]; then
    cat "$logs/torchrun-$procs"
    find "$logs/torch-logs-$procs" -name '*.log' -print -exec cat {} \;
    exit "$status"
  fi
done

echo "== summary"
summary() { grep -E '^[0-9]+ (passed|failed|skipped|deselected)' "$1" | head -n 1; }
printf '%-20s %s\n' "types" "$(tail -n 1 "$logs/types")" "serial" "$(summary "$logs/serial")"
for ranks in 1 2 3 4; do
  printf '%-20s %s\n' "MPI at $ranks rank(s)" "$(summary "$logs/mpi-$ranks")"
done
for procs in "${torch_sizes[@]}"; do
  printf '%-20s %s\n' "torch at $procs proc(s)" "$(summary "$logs/torch-$procs")"
done
