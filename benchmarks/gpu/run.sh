#!/usr/bin/env bash
# Everything drivetrain checks on a GPU, in one command, from a checkout: on a machine with a
# GPU and a Python with torch, no network, and at most 64 MiB of files brought along.
#
#   bash benchmarks/gpu/run.sh              # the GPU run (about 10 minutes on one H100)
#   bash benchmarks/gpu/run.sh --cpu-smoke  # every step it can on the CPU (CI's slow set)
#   STEPS=gpu-tests,mfu bash benchmarks/gpu/run.sh  # only these (install and wheels always
#                                                   # run): to split a run across calls
#   LOG_DIR=$OUT bash benchmarks/gpu/run.sh  # keep every step's log and the JSON there
#
# Steps: install the workspace's wheels from WHEELS (default .whl, made beforehand by
# benchmarks/gpu/prepare.sh) into a scratch target with pip (--no-index --no-deps); every
# `gpu` test; the MFU table (benchmarks/gpu/mfu.py); weight sync on the device
# (benchmarks/weight_sync.py); the built-in GRPO job from an empty cache, then over three
# seeds (benchmarks/grpo_seeds.py). Each step's output goes to the log; the last line is JSON
# with the headline numbers: dense_mfu, dense_vs_plain, packed_vs_dense_mfu,
# megatron_peak_vs_fsdp2, grpo_greedy_delta_min, gpu_tests (passed/failed/skipped),
# weight_sync, grpo, device. A failing step is reported there and fails the run.
set -euo pipefail
cd "$(dirname "$0")/../.."
SMOKE=""
[ "${1:-}" = "--cpu-smoke" ] && SMOKE=--cpu-smoke
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/drivetrain-gpu-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
LOGS=${LOG_DIR:-$WORK}  # each step's log as it ends: a run cut short keeps what it finished
mkdir -p "$LOGS"
ls "$WHEELS"/*.whl >/dev/null 2>&1 || {
  echo "no wheels in $WHEELS: run benchmarks/gpu/prepare.sh first (see its header)" >&2
  exit 2
}
status=0
step() {  # step NAME COMMAND...: run it, its output to the log and to $LOGS/NAME.log
  local name=$1 begin
  shift
  case "$name" in install | wheels) ;; *)
    if [ -n "${STEPS:-}" ] && [[ ",$STEPS," != *",$name,"* ]]; then return 0; fi ;;
  esac
  begin=$(date +%s)
  echo "== $name"
  if "$@" 2>&1 | tee "$LOGS/$name.log"; then
    echo "== $name: ok in $(($(date +%s) - begin)) s"
  else
    echo "== $name: FAILED after $(($(date +%s) - begin)) s"
    echo "$name" >>"$LOGS/failed"
    status=1
  fi
}

install() {  # pip where the Python has it (the GPU machine); uv's environments have none
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --no-index --no-deps --target "$WORK/site" "$WHEELS"/*.whl
  else
    uv pip install --quiet --no-index --no-deps --python "$PY" --target "$WORK/site" \
      "$WHEELS"/*.whl
  fi
}
step install install
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
# an empty cache: the built-in job trains its SFT default first (a caller may lend a cache)
export DRIVETRAIN_CACHE=${DRIVETRAIN_CACHE:-$WORK/cache} OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# the wheels, not a checkout's sources, are what runs
step wheels "$PY" -c "import drivetrain.trainer.cli as m, drivetrain.engine.fsdp.engine as e
print(m.__file__, e.__file__); assert {m.__file__[:len('$WORK/site')], e.__file__[:len('$WORK/site')]} == {'$WORK/site'}"
# pytest-xdist may be absent there: the project's addopts are replaced
step gpu-tests "$PY" -m pytest -o addopts="" -p no:cacheprovider --import-mode=importlib -m gpu \
  -q -rfE --junitxml "$LOGS/gpu-tests.xml" packages tests
step mfu "$PY" benchmarks/gpu/mfu.py $SMOKE --profile
if [ -n "$SMOKE" ]; then
  step weight-sync "$PY" benchmarks/weight_sync.py --quick --transports colocated
  # the built-in job, two steps (its SFT default comes from DRIVETRAIN_CACHE when lent one)
  step grpo "$PY" -m drivetrain.trainer grpo run.steps=2 run.output_dir="$WORK/grpo" \
    logging.progress=false
  step grpo-seeds "$PY" benchmarks/grpo_seeds.py --quick --dtypes default
else
  step weight-sync "$PY" benchmarks/weight_sync.py --device cuda --transports colocated,disk \
    --sizes 500M,many
  step grpo "$PY" -m drivetrain.trainer grpo run.output_dir="$WORK/grpo" logging.progress=false
  # the same job over seeds 0-2 as a user gets it here (the cache's SFT model): does it rise?
  step grpo-seeds "$PY" benchmarks/grpo_seeds.py --seeds 3 --dtypes default
fi
"$PY" benchmarks/gpu/summary.py "$LOGS" | tee "$LOGS/summary.json"
exit "$status"
