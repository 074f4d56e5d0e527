#!/usr/bin/env bash
# The engine harness on the GPU machine (no network there). Carry (paths
# relative to the repository root): .engine-wheels/carry (prepare.sh) and a
# folder with tp-allreduce's wheel (build-wheel.sh), e.g. dist/.
#
#   bash python/engine_checks/run-on-gpu.sh WHEEL_DIR [--dry-run]
#
# 1. one venv per carry/<venv>.install (sglang, vllm-0.33.0, vllm-0.34.0:
#    SGLang and vLLM pin different versions of some packages, and each
#    pinned vLLM version has its own) on /opt/torch/.venv/bin/python3
#    (torch 2.11; BASE_PYTHON overrides), seeing that interpreter's packages
#    after its own; pip install --no-index --no-deps of tp-allreduce's wheel
#    (its .pth and entry point active, as users get them) and of the wheels
#    that <venv>.install lists; the versions and a requirements report;
# 2. MPS when there are fewer GPUs than ranks (2 ranks share GPU 0);
# 3. the checks (run_checks.py: SGLang; vLLM 0.33.0 switch on / off /
#    batch invariant; vLLM 0.34.0 on / off), each bounded, a crashed rank ending its run at once; logs
#    and per-rank JSON under $OUT;
# 4. MPS stopped. Exit status non-zero on any failure.
#
# --dry-run (a machine without a GPU, e.g. before carrying): the same venvs,
# then run_checks --dry-run (imports with CUDA stood in, the engines'
# distributed setup on CPU). CARRY overrides the carry folder (a carry
# prepared for this machine's Python: prepare.py --python-version).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
wheels="$(cd "${1:?usage: run-on-gpu.sh WHEEL_DIR [--dry-run]}" && pwd)"
dry=0
[[ "${2:-}" == "--dry-run" ]] && dry=1
carry="$(cd "${CARRY:-$ROOT/.engine-wheels/carry}" && pwd)" || exit 1
out="${OUT:-$ROOT/.cache/engine-checks}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
base="${BASE_PYTHON:-/opt/torch/.venv/bin/python3}"
work="$(mktemp -d)"
exec > >(tee "$out/run-on-gpu.log") 2>&1
start=$SECONDS
ours=$(ls "$wheels"/tp_allreduce-*.whl | tail -1)
[[ -f "$ours" ]] || { echo "run-on-gpu: no tp_allreduce wheel in $wheels"; exit 1; }

make_venv() { # VENV (sglang, vllm-0.33.0, ...) -> $work/venv-VENV
    local name=$1 engine=${1%%-*} venv="$work/venv-$1" site_pkgs
    "$base" -m venv "$venv" || return 1
    # The packages the base interpreter sees (/opt/torch/.venv's: torch, ...),
    # after the venv's own, through a .pth file (--system-site-packages
    # would reach the system interpreter's, not those of the venv that the
    # base interpreter belongs to). The venv then sees exactly what the base
    # interpreter sees, here and in a dry run elsewhere.
    site_pkgs="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || return 1
    "$base" - "$site_pkgs/_tp_allreduce_base_env.pth" <<'EOF2' || return 1
import site, sys
dirs = [d for d in site.getsitepackages() + [site.getusersitepackages()] if d]
with open(sys.argv[1], "w") as f:
    f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
EOF2
    local files=()
    while read -r f; do [[ -n "$f" ]] && files+=("$carry/$f"); done <"$carry/$name.install"
    timeout 180 "$venv/bin/python" -m pip install --quiet --no-index --no-deps --disable-pip-version-check "$ours" "${files[@]}" || {
        echo "run-on-gpu: pip install into the $name venv failed"
        return 1
    }
    "$venv/bin/python" - "$engine" <<'PY'
import importlib.metadata as md, os, site, sys
engine = sys.argv[1]
print(f"{engine} venv:", ", ".join(f"{d} {md.version(d)}" for d in ("tp-allreduce", engine, "torch")))
if engine == "vllm":
    print("  vllm.platform_plugins entry points:", [e.value for e in md.entry_points(group="vllm.platform_plugins")])
else:
    print("  tp_allreduce_sglang.pth installed:", any(os.path.exists(os.path.join(p, "tp_allreduce_sglang.pth")) for p in site.getsitepackages()))
PY
    "$venv/bin/python" "$ROOT/python/engine_checks/deps_report.py" "$engine" "$carry/$name.install"
}

names=()
for list in "$carry"/*.install; do names+=("$(basename "$list" .install)"); done
pythons=()
for name in "${names[@]}"; do
    make_venv "$name" || { echo "run-on-gpu: the $name venv could not be made"; rm -rf "$work"; exit 1; }
    pythons+=(--python "$name=$work/venv-$name/bin/python")
done
echo "run-on-gpu: venvs made in $((SECONDS - start)) s"

mps=0
if [[ $dry == 0 ]]; then
    nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$out/gpus.txt"
    ngpu=$(nvidia-smi -L | grep -c '^GPU ')
    if [[ "$ngpu" -lt 2 ]]; then
        export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        nvidia-cuda-mps-control -d && mps=1 && echo "run-on-gpu: MPS started (2 ranks share GPU 0)"
    fi
fi
# The harness (a copy: python/ itself holds tp_allreduce's sources, which
# must not shadow the installed wheel) and the stubs of stubs/path
# (sgl_kernel) on the path of every rank; the carried vLLM wheel holds its
# own (vllm/_C_stable_libtorch.py).
harness="$work/harness"
mkdir -p "$harness" && cp -r "$ROOT/python/engine_checks" "$harness/"
export PYTHONPATH="$harness:$ROOT/python/engine_checks/stubs/path${PYTHONPATH:+:$PYTHONPATH}"
cd "$harness" || exit 1
extra=()
[[ $dry == 1 ]] && extra=(--dry-run)
limit=$((dry == 1 ? 3000 : 540))
timeout "$limit" "$work/venv-${names[-1]}/bin/python" -m engine_checks.run_checks "$out" --world 2 \
    "${pythons[@]}" "${extra[@]}"
status=$?
[[ $status -eq 124 ]] && echo "run-on-gpu: the checks ran past $limit s (killed)"
if [[ "$mps" == 1 ]]; then
    echo quit | nvidia-cuda-mps-control
    cp /tmp/mps-log/control.log "$out/mps-control.log" 2>/dev/null || true
fi
echo "run-on-gpu: done in $((SECONDS - start)) s, status $status"
cd / && rm -rf "$work"
exit "$status"
