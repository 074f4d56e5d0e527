#!/usr/bin/env bash
# The GPU test suites as one command on a 2-GPU machine (the GPU
# machine has no Rust: build here first with `bash benches/gpu/build-dev.sh`, and
# `bash python/build-wheel.sh .dev/wheels --with-pytest` for step 3):
#   1. the integration suite's GPU tests, without MPS, with 2 GPUs required
#      (tests that put two ranks' processes on one GPU skip visibly here);
#   2. under MPS, the tests whose processes share a GPU (4 processes on 2
#      GPUs, mixed placement);
#   3. the new kernel families (payload-completion island push, copy-engine
#      ring, fused epilogue);
#   4. the Python package's GPU tests (WITH_PYTHON=1) and the candle example
#      on 2 GPUs (when .dev/candle_tp exists).
# The CPU-only parts (cpu::, ptx::, cli::, sentinel_model::) run in CI and
# read the repository at its build path, so they are skipped here.
#
#   OUT=<dir> [PARTS="main mps new"] bash benches/gpu/gpu-suite.sh
# $OUT receives summary.txt, log.txt and gpu-suite.tar.gz (every log).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-results/gpu-suite}
BUDGET=${BUDGET:-560}
mkdir -p "$OUT"
W=$(mktemp -d /tmp/gpu-suite.XXXXXX)
source benches/gpu/steps.sh
export TP_ALLREDUCE_BIN=$PWD/.dev/tp-allreduce TP_ALLREDUCE_TUNING_FILE=$W/no-tuning-table.toml
SKIP_CPU=(--skip cpu:: --skip ptx:: --skip cli:: --skip sentinel_model::)
nvidia-smi --query-gpu=index,name,driver_version --format=csv > "$W/gpus.txt" 2>&1

T="env TP_ALLREDUCE_REQUIRE_GPU=1 TP_ALLREDUCE_REQUIRE_GPUS=2 .dev/suite --test-threads=1"
# The new kernels' families run in their own step, after the rest.
# PARTS picks the steps (one run may not have time for them all):
# "main mps new" by default.
PARTS=" ${PARTS:-main mps new} "
[[ $PARTS == *" main "* ]] &&
  step suite "${SUITE_LIMIT:-270}" $T "${SKIP_CPU[@]}" --skip gpu_fused --skip gpu_pcie_family ${SUITE_FILTER:-}

if [[ $PARTS == *" mps "* ]] && mps_start; then
  step suite-mps 60 env TP_ALLREDUCE_REQUIRE_GPU=1 TP_ALLREDUCE_REQUIRE_MPS=1 CUDA_DEVICE_MAX_CONNECTIONS=2 \
    .dev/suite --test-threads=1 multiprocess::multi_process_selftest_4_ranks_in_islands_of_2 \
    multiprocess::sigkill_of_one_rank_fails_the_others_cleanly
  mps_stop
fi

[[ $PARTS == *" new "* ]] && step suite-new "${NEW_LIMIT:-330}" $T gpu_pcie_family gpu_fused

if ls .dev/wheels/tp_allreduce-*.whl > /dev/null 2>&1 && [ -n "${WITH_PYTHON:-}" ]; then
  step python 200 env OUT="$W/python" bash python/run-gpu-checks.sh .dev/wheels
fi
if [ -x .dev/candle_tp ] || [ -f .dev/candle_tp.xz ]; then
  step candle 60 env OUT="$W/candle" bash benches/gpu/candle-gpu.sh
fi

{
  echo "GPU suites (test results per step):"
  for f in "$W"/suite.log "$W"/suite-mps.log "$W"/suite-new.log; do
    [ -f "$f" ] || continue
    echo "-- $(basename "$f"): $(grep -E '^test result' "$f" | tail -1)"
    grep -E '^test .* FAILED|^failures:' "$f" | head -20
    echo "   skipped tests: $(bash .ci/count-skips "$f")"
  done
  [ -f "$W/python/pytest.log" ] && echo "-- python: $(grep -E '[0-9]+ passed' "$W/python/pytest.log" | tail -1)"
  [ -f "$W/python/tp_decode_step.log" ] && tail -n 15 "$W/python/tp_decode_step.log"
  echo "steps (name, exit status, seconds):"
  cat "$W/steps.txt"
} > "$W/summary.txt" 2>&1
cat "$W/summary.txt"
cp "$W/summary.txt" "$LOG" "$OUT/"
tar -czf "$OUT/gpu-suite.tar.gz" -C "$W" . 2>/dev/null
echo "total $((SECONDS - START)) s"
