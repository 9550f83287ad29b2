#!/usr/bin/env bash
# The checks only a GPU can run, in one go of at most 8 minutes:
#   1. the CUDA variants of the tests (aggregators, tasks);
#   2. a 2-peer swarm with --device cuda: sync; diloco with int8; diloco with int8 and --verify;
#   3. how far two honest replays of H inner steps differ on this GPU, and from a CPU replay: the
#      margin under the tolerance validators of verified diloco rounds accept (phalanx bench replay).
# Each step has its own time limit; the script prints PASS or FAIL per step, then the replay table, and
# exits 1 if any step failed. Logs stay in $GPU_CHECK_DIR (default: a new temporary folder).
#
#   bash scripts/gpu-check.sh          # on a machine with a CUDA GPU, after the README's install
#   bash scripts/gpu-check.sh --cpu    # a rehearsal of the same steps on the CPU: it checks no GPU
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DIR=${GPU_CHECK_DIR:-$(mktemp -d -t phalanx-gpu-check-XXXXXX)}
mkdir -p "$DIR"

DEV=cuda
if [ "${1:-}" = "--cpu" ]; then
  DEV=cpu
  echo "REHEARSAL ON THE CPU: every step runs on --device cpu; nothing here checks a GPU"
elif [ -n "${1:-}" ]; then
  echo "error: $1: the only option is --cpu (a rehearsal on the CPU)" >&2
  exit 2
fi

if ! "$PY" -c "import phalanx" 2>/dev/null; then
  echo "error: $PY cannot import phalanx; install it first (the README's first command) or set PYTHON" >&2
  exit 2
fi
if [ "$DEV" = cuda ]; then
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: torch ($PY) sees no CUDA GPU here; run this where one is (or --cpu to rehearse)" >&2
    exit 3
  fi
  "$PY" -c "import torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}:', ', '.join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))"
fi
echo "logs: $DIR"

failed=0
summary=()
step() {  # step NAME LIMIT_S COMMAND...: run it, its output to NAME.log, and say PASS or FAIL
  local name=$1 limit=$2
  shift 2
  local began=$SECONDS code
  echo "== $name (at most ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" > "$DIR/$name.log" 2>&1
  code=$?
  local took=$((SECONDS - began))
  if [ $code -eq 0 ]; then
    summary+=("PASS  $name  ${took} s")
  else
    [ $code -eq 124 ] && why="timed out" || why="exit $code"
    summary+=("FAIL  $name  ${took} s ($why; $DIR/$name.log)")
    tail -n 15 "$DIR/$name.log"
    failed=1
  fi
}

# 1. the tests' CUDA variants; on a GPU, one skipped for want of CUDA is a failure
step cuda-tests 100 "$PY" -m pytest -q -p no:cacheprovider -rs -k cuda tests/aggregation tests/tasks/test_task_base.py
if [ "$DEV" = cuda ] && grep -qiE "CUDA (NOT|is not) AVAILABLE" "$DIR/cuda-tests.log"; then
  summary+=("FAIL  cuda-tests: some were skipped for want of CUDA ($DIR/cuda-tests.log)")
  failed=1
fi

# 2. swarms of 2 trainers on the device, to digits' 0.95 test accuracy within the step budget
swarm=("$PY" -m phalanx swarm --peers 2 --device "$DEV" --steps 1500)
step swarm-sync 80 "${swarm[@]}" --workdir "$DIR/sync"
step swarm-diloco-int8 90 "${swarm[@]}" --workdir "$DIR/diloco" --mode diloco --compression int8
step swarm-diloco-int8-verify 110 "${swarm[@]}" --workdir "$DIR/verify" --mode diloco --compression int8 \
  --aggregator centered_clip --tau 1 --verify

# 3. replays: two on the device, and one on the CPU, against the first
if [ "$DEV" = cuda ]; then devices=cuda,cuda,cpu; else devices=cpu,cpu; fi
step replay 90 "$PY" -m phalanx bench replay --devices "$devices" --threads 1 --inner-steps 50

echo
printf '%s\n' "${summary[@]}"
echo
echo "replays (tiny-gpt, H = 50; tolerance: contribution_rtol):"
grep -E "│|┃|replays against" "$DIR/replay.log" || echo "(no table: see $DIR/replay.log)"
[ "$DEV" = cpu ] && echo "REHEARSAL ON THE CPU: nothing above checked a GPU"
exit $failed
