#!/usr/bin/env bash
# The engine harness on the GPU machine (no network there). Carry (paths
# relative to the repository root): .engine-wheels/carry (prepare.sh) and a
# folder with tp-allreduce's wheel (build-wheel.sh), e.g. dist/.
#
#   bash python/engine_checks/run-on-gpu.sh WHEEL_DIR
#
# 1. a venv with --system-site-packages on /opt/torch/.venv/bin/python3
#    (torch 2.11), pip install --no-index --no-deps of tp-allreduce's wheel
#    (its .pth and entry point active, as users get them) and of the carried
#    engine and dependency wheels;
# 2. MPS when there are fewer GPUs than ranks (2 ranks share GPU 0);
# 3. the checks (run_checks.py: SGLang, vLLM switch on / off / batch
#    invariant), each bounded; logs and per-rank JSON under $OUT;
# 4. MPS stopped. Exit status non-zero on any failure.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
wheels="$(cd "${1:?usage: run-on-gpu.sh WHEEL_DIR}" && pwd)"
out="${OUT:-$ROOT/.cache/engine-checks}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
base="${BASE_PYTHON:-/opt/torch/.venv/bin/python3}"
venv="$(mktemp -d)/venv"
exec > >(tee "$out/run-on-gpu.log") 2>&1
start=$SECONDS
"$base" -m venv --system-site-packages "$venv" || exit 1
py="$venv/bin/python"
# --system-site-packages reaches the base interpreter's system packages, not
# those of a venv it belongs to (/opt/torch/.venv holds torch): a .pth file
# adds them after the venv's own.
site_pkgs="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$base" - "$site_pkgs/_tp_allreduce_base_env.pth" <<'EOF2' || exit 1
import site, sys
dirs = [d for d in site.getsitepackages() + [site.getusersitepackages()] if d]
with open(sys.argv[1], "w") as f:
    f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
EOF2
ours=$(ls "$wheels"/tp_allreduce-*.whl | tail -1)
timeout 120 "$py" -m pip install --quiet --no-index --no-deps --disable-pip-version-check "$ours" "$ROOT"/.engine-wheels/carry/*.whl || {
    echo "run-on-gpu: pip install failed"
    exit 1
}
echo "run-on-gpu: installed in $((SECONDS - start)) s"
"$py" - <<'PY'
import importlib.metadata as md, os, site
for d in ("tp-allreduce", "sglang", "vllm", "torch"):
    print(f"version {d} {md.version(d)}")
eps = [e.value for e in md.entry_points(group="vllm.platform_plugins")]
print("vllm.platform_plugins entry points:", eps)
print(".pth installed:", any(os.path.exists(os.path.join(p, "tp_allreduce_sglang.pth")) for p in site.getsitepackages()))
PY
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$out/gpus.txt"
ngpu=$(nvidia-smi -L | grep -c '^GPU ')
mps=0
if [[ "$ngpu" -lt 2 ]]; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && mps=1 && echo "run-on-gpu: MPS started (2 ranks share GPU 0)"
fi
# The harness (a copy: python/ itself holds tp_allreduce's sources, which
# must not shadow the installed wheel) and the stubs of stubs/path
# (sgl_kernel) on the path of every rank; the carried vLLM wheel holds its
# own (vllm/_C_stable_libtorch.py).
harness="$(dirname "$venv")/harness"
mkdir -p "$harness" && cp -r "$ROOT/python/engine_checks" "$harness/"
export PYTHONPATH="$harness:$ROOT/python/engine_checks/stubs/path${PYTHONPATH:+:$PYTHONPATH}"
cd "$harness" || exit 1
timeout 480 "$py" -m engine_checks.run_checks "$out" --world 2
status=$?
[[ $status -eq 124 ]] && echo "run-on-gpu: the checks ran past 480 s (killed)"
if [[ "$mps" == 1 ]]; then
    echo quit | nvidia-cuda-mps-control
    cp /tmp/mps-log/control.log "$out/mps-control.log" 2>/dev/null || true
fi
echo "run-on-gpu: done in $((SECONDS - start)) s, status $status"
rm -rf "$(dirname "$venv")"
exit "$status"
