#!/usr/bin/env bash
# Runs the Python package's tests and the end-to-end decode step on a GPU
# machine (PyTorch installed; 2+ GPUs for test_gpu.py, one GPU serves the
# rest) from a prebuilt wheel: no Rust and no network needed there.
#
#   PYTHON=/opt/torch/.venv/bin/python bash python/run-gpu-checks.sh WHEEL_DIR
#
# WHEEL_DIR holds tp_allreduce-*.whl from build-wheel.sh (and, for machines
# whose Python has no pytest, the pytest wheels: build-wheel.sh OUT
# --with-pytest). PYTHON (default python3) is the interpreter with PyTorch.
#
# The wheel is installed with pip (offline: --no-index --no-deps) into a
# private venv whose site-packages come first and that also sees PYTHON's
# site-packages (PyTorch); the machine's Python is not modified. Installed
# this way the wheel's .pth file (TP_ALLREDUCE_SGLANG=1) and entry points
# (vLLM's plugin) are active, as after a user's `pip install`. Then:
#   1. pytest python/tests with TP_ALLREDUCE_REQUIRE_GPU=1 (torch/GPU tests
#      must run: a skip for want of them fails, see tests/conftest.py);
#   2. python/examples/tp_decode_step.py (both allocator configurations;
#      SKIP_DECODE=1 leaves it out).
# PYTEST_ARGS (e.g. "python/tests/test_gpu_lifecycle.py") replaces the test
# selection. Logs, the JUnit XML, the GPU suites' per-check details
# (gpu-suite-*.json, gpu-lifecycle-*.json) and the decode step's JSON report
# go to $OUT (or .cache/gpu-checks). Exit status is non-zero if a step failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
wheels="$(cd "${1:?usage: run-gpu-checks.sh WHEEL_DIR}" && pwd)"
out="${OUT:-$ROOT/.cache/gpu-checks}"
mkdir -p "$out"
work="$(mktemp -d)"
venv="$work/venv"
trap 'rm -rf "$work"' EXIT

fail() {
    echo "run-gpu-checks: $*" >&2
    exit 1
}

wheel="$(ls -1 "$wheels"/tp_allreduce-*.whl 2>/dev/null | sort | tail -n 1)"
[[ -n "$wheel" ]] || fail "no tp_allreduce-*.whl in $wheels"
"$PYTHON" -c "import torch" 2>/dev/null || fail "$PYTHON cannot import torch (set PYTHON=, e.g. /opt/torch/.venv/bin/python)"

# The venv (with pip from ensurepip when the interpreter has it).
"$PYTHON" -m venv "$venv" 2>/dev/null || "$PYTHON" -m venv --without-pip "$venv" || fail "cannot create a venv"
vpy="$venv/bin/python"
# PYTHON's site-packages (PyTorch, maybe pytest) after the venv's own: a
# .pth line that imports runs site.addsitedir, which also reads their .pth files.
site_pkgs="$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$PYTHON" - "$site_pkgs/_tp_allreduce_base_env.pth" <<'EOF' || fail "cannot link $PYTHON's site-packages"
import site, sys
dirs = [d for d in site.getsitepackages() + [site.getusersitepackages()] if d]
with open(sys.argv[1], "w") as f:
    f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
EOF
if "$vpy" -m pip --version >/dev/null 2>&1; then
    pip=("$vpy" -m pip)
else
    pip=("$PYTHON" -m pip --python "$vpy")
fi
"${pip[@]}" install --quiet --disable-pip-version-check --no-index --no-deps "$wheel" || fail "pip could not install $wheel"
echo "run-gpu-checks: installed $(basename "$wheel") into $venv with pip"
if ! "$vpy" -c "import pytest" 2>/dev/null; then
    "${pip[@]}" install --quiet --disable-pip-version-check --no-index --find-links "$wheels" pytest \
        || fail "pytest is not installed; build the wheel dir with build-wheel.sh --with-pytest"
fi
# The import must come from the venv, and the .pth switch must be live.
TP_ALLREDUCE_SGLANG=1 "$vpy" - "$venv" <<'EOF' || fail "torch not importable in the venv, the package not the venv's, or its .pth file not read"
import os, sys
import torch  # noqa: F401 (PYTHON's, through the .pth above)
import tp_allreduce
assert os.path.realpath(tp_allreduce.__file__).startswith(os.path.realpath(sys.argv[1])), tp_allreduce.__file__
assert "tp_allreduce._sglang_hook" in sys.modules, "tp_allreduce_sglang.pth did not run"
EOF

export TP_ALLREDUCE_REQUIRE_GPU=1 OUT="$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$ROOT" || exit 1
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader >"$out/gpus.txt" 2>&1 || true

status=0
start=$SECONDS
# shellcheck disable=SC2086
timeout 480 "$vpy" -m pytest ${PYTEST_ARGS:-python/tests} -v -rs -p no:cacheprovider --junitxml="$out/pytest.xml" 2>&1 \
    | tee "$out/pytest.log" || status=1
echo "run-gpu-checks: pytest took $((SECONDS - start)) s" | tee -a "$out/pytest.log"
if [[ -z "${SKIP_DECODE:-}" ]]; then
    start=$SECONDS
    timeout 420 "$vpy" python/examples/tp_decode_step.py --json "$out/tp_decode_step.json" 2>&1 \
        | tee "$out/tp_decode_step.log" || status=1
    echo "run-gpu-checks: tp_decode_step took $((SECONDS - start)) s" | tee -a "$out/tp_decode_step.log"
fi
exit "$status"
