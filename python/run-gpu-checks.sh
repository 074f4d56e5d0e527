#!/usr/bin/env bash
# Runs the Python package's tests and the end-to-end decode step on a GPU
# machine (2+ GPUs, PyTorch installed) from a prebuilt wheel: no Rust and no
# network needed there.
#
#   bash python/run-gpu-checks.sh WHEEL_DIR
#
# WHEEL_DIR holds tp_allreduce-*.whl from build-wheel.sh (and, for machines
# without pytest, the pytest wheels: build-wheel.sh OUT --with-pytest). The
# wheels are unpacked into a private directory put on PYTHONPATH (the
# machine's Python is not modified). Then:
#   1. pytest python/tests with TP_ALLREDUCE_REQUIRE_GPU=1 (torch/GPU tests
#      must run: a skip for want of them fails);
#   2. python/examples/tp_decode_step.py (both allocator configurations).
# Logs, the JUnit XML, the GPU suites' per-check details (gpu-suite-*.json) and
# the decode step's JSON report go to $OUT (or .cache/gpu-checks).
# Exit status is non-zero if either step failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
wheels="$(cd "${1:?usage: run-gpu-checks.sh WHEEL_DIR}" && pwd)"
out="${OUT:-$ROOT/.cache/gpu-checks}"
mkdir -p "$out"
site="$(mktemp -d)/site"

"$PYTHON" - "$wheels" "$site" <<'EOF' || exit 1
import glob, importlib.util, os, sys, zipfile

wheels, site = sys.argv[1:]
ours = sorted(glob.glob(os.path.join(wheels, "tp_allreduce-*.whl")))
if not ours:
    sys.exit(f"run-gpu-checks: no tp_allreduce-*.whl in {wheels}")
chosen = [ours[-1]]
if importlib.util.find_spec("pytest") is None:
    others = [w for w in glob.glob(os.path.join(wheels, "*.whl")) if w not in ours]
    if not any(os.path.basename(w).startswith("pytest-") for w in others):
        sys.exit("run-gpu-checks: pytest is not installed; build the wheel dir with build-wheel.sh --with-pytest")
    chosen += others
for wheel in chosen:  # a wheel is a zip laid out like site-packages
    zipfile.ZipFile(wheel).extractall(site)
    print(f"run-gpu-checks: unpacked {os.path.basename(wheel)}")
EOF

export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export TP_ALLREDUCE_REQUIRE_GPU=1 OUT="$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$ROOT" || exit 1
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader >"$out/gpus.txt" 2>&1 || true

status=0
start=$SECONDS
timeout 420 "$PYTHON" -m pytest python/tests -v -rs -p no:cacheprovider --junitxml="$out/pytest.xml" 2>&1 \
    | tee "$out/pytest.log" || status=1
echo "run-gpu-checks: pytest took $((SECONDS - start)) s" | tee -a "$out/pytest.log"
start=$SECONDS
timeout 420 "$PYTHON" python/examples/tp_decode_step.py --json "$out/tp_decode_step.json" 2>&1 \
    | tee "$out/tp_decode_step.log" || status=1
echo "run-gpu-checks: tp_decode_step took $((SECONDS - start)) s" | tee -a "$out/tp_decode_step.log"
rm -rf "$(dirname "$site")"
exit "$status"
