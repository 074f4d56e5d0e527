#!/usr/bin/env bash
# Installs the CUDA 13.0 build toolkit that the `candle` feature's build
# needs into <repo>/.cache/cuda-13.0 (no root, no system install), from
# NVIDIA's PyPI wheels, and prints the environment to build with:
#
#   eval "$(bash .ci/candle-toolkit.sh --env)"     # CUDA_HOME, NVCC, PATH, ...
#
# Why: candle-core's CUDA backend (candle-kernels' build script, through the
# cudaforge crate) compiles its .cu kernels with nvcc at build time - even for
# `cargo check` - and candle-core's cudarc links the CUDA libraries
# (cudarc feature `dynamic-linking`) instead of loading them at run time.
# The default build of tp-allreduce needs none of this.
#
# What it installs:
# * nvcc, cicc, ptxas, fatbinary, nvlink and the headers (CUDA runtime, CRT,
#   CCCL) - from the wheels nvidia-cuda-nvcc, nvidia-nvvm, nvidia-cuda-crt,
#   nvidia-cuda-runtime, nvidia-cuda-cccl (all CUDA 13.0);
# * libcudart.so.13 (real, from nvidia-cuda-runtime): candle-kernels' static
#   kernel library links it;
# * link stubs in lib/stubs for libcuda.so.1, libnvrtc.so.13,
#   libcublas.so.13, libcublasLt.so.13, libcurand.so.10 and libnccl.so.2:
#   shared libraries with the real sonames whose every function returns an
#   error (for libcuda: 34, CUDA_ERROR_STUB_LIBRARY), generated from the
#   function list of cudarc's bindings - the same idea as the CUDA toolkit's
#   own lib64/stubs. A binary linked against them needs the real libraries
#   at run time (the GPU machine's driver and PyTorch's NVIDIA wheels, see
#   .ci/candle-gpu.sh); on a machine without a GPU the stubs let the test
#   binary start and every CUDA probe fail cleanly ("no CUDA device").
#
# * bin/nvcc-cached, the nvcc that --env names (NVCC): nvcc with a result
#   cache in <repo>/.cache/nvcc. candle-kernels' build script runs once per
#   distinct build of its build-time dependencies, and those differ between
#   `--no-default-features --features candle` and `--features candle` (the
#   tools' proc macros add syn/serde features to the host side, cudaforge
#   included), so without it candle.sh compiles candle's CUDA kernels twice.
#   The key covers nvcc's arguments (the output path aside), the toolkit's
#   pinned versions, the host C++ compiler, the NVCC_* settings and every
#   CUDA source and header of the crate being built; only compiles of one
#   .cu file run by a cargo build script are cached.
#
# Idempotent: a toolkit already installed at the pinned versions is kept.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$ROOT/.cache"
WHEELS="$CACHE/wheels"
PREFIX="$CACHE/cuda-13.0"
PYTHON="${PYTHON:-python3}"

# Pinned wheels (name==version), all CUDA 13.0.
PINS=(
    "nvidia-cuda-nvcc==13.0.88"
    "nvidia-nvvm==13.0.88"
    "nvidia-cuda-crt==13.0.88"
    "nvidia-cuda-runtime==13.0.96"
    "nvidia-cuda-cccl==13.0.85"
)
# cudarc's CUDA version feature matching this toolkit.
CUDARC_VERSION="13000"
# The CUDA compute capability the kernels are built for (sm_90: H100/H200).
COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
STAMP="$PREFIX/.installed"
WANT_STAMP="${PINS[*]} stubs-v1"

print_env() {
    cat <<EOF
export CUDA_HOME="$PREFIX"
export NVCC="$PREFIX/bin/nvcc-cached"
export PATH="$PREFIX/bin:\$PATH"
export CUDARC_CUDA_VERSION="$CUDARC_VERSION"
export CUDA_COMPUTE_CAP="$COMPUTE_CAP"
export LD_LIBRARY_PATH="$PREFIX/lib:$PREFIX/lib/stubs:\${LD_LIBRARY_PATH:-}"
EOF
}

install() {
    if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT_STAMP" ]]; then
        echo "cuda-13.0 toolkit: already installed in $PREFIX" >&2
        return
    fi
    mkdir -p "$WHEELS"
    local missing=()
    for pin in "${PINS[@]}"; do
        local name="${pin%%==*}" version="${pin##*==}"
        compgen -G "$WHEELS/${name//-/_}-${version}-*.whl" >/dev/null || missing+=("$pin")
    done
    if ((${#missing[@]})); then
        echo "cuda-13.0 toolkit: downloading ${missing[*]}" >&2
        "$PYTHON" -m pip download --no-deps --only-binary=:all: --disable-pip-version-check \
            --quiet "${missing[@]}" -d "$WHEELS" >&2
    fi
    rm -rf "$PREFIX.tmp"
    mkdir -p "$PREFIX.tmp"
    local wheels=()
    for pin in "${PINS[@]}"; do
        local name="${pin%%==*}" version="${pin##*==}"
        wheels+=("$(compgen -G "$WHEELS/${name//-/_}-${version}-*.whl" | head -n1)")
    done
    # Every wheel holds nvidia/cu13/<bin|include|lib|nvvm>/...: merge them.
    "$PYTHON" - "$PREFIX.tmp" "${wheels[@]}" <<'PY'
import os, sys, zipfile
dest, wheels = sys.argv[1], sys.argv[2:]
prefix = "nvidia/cu13/"
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            if not name.startswith(prefix) or name.endswith("/") or "/.metadata/" in name:
                continue
            out = os.path.join(dest, name[len(prefix):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(info) as src, open(out, "wb") as dst:
                dst.write(src.read())
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(out, mode)
PY
    chmod +x "$PREFIX.tmp"/bin/* "$PREFIX.tmp"/nvvm/bin/* 2>/dev/null || true
    ln -sf libcudart.so.13 "$PREFIX.tmp/lib/libcudart.so"
    make_stubs "$PREFIX.tmp/lib/stubs"
    echo "$WANT_STAMP" >"$PREFIX.tmp/.installed"
    rm -rf "$PREFIX"
    mv "$PREFIX.tmp" "$PREFIX"
    echo "cuda-13.0 toolkit: installed in $PREFIX ($("$PREFIX/bin/nvcc" --version | tail -n 2 | head -n 1))" >&2
}

# make_stubs DIR: the link stubs, one per library cudarc links under
# `dynamic-linking`, from the functions its bindings declare.
make_stubs() {
    local dir="$1"
    mkdir -p "$dir"
    local cudarc
    cudarc="$(cd "$ROOT" && cargo metadata --format-version 1 --quiet 2>/dev/null |
        "$PYTHON" -c 'import json,sys,os; m=json.load(sys.stdin); print(next(os.path.dirname(p["manifest_path"]) for p in m["packages"] if p["name"]=="cudarc"))')"
    "$PYTHON" - "$cudarc/src" "$dir" <<'PY'
import os, re, subprocess, sys
src, dest = sys.argv[1], sys.argv[2]
# (cudarc bindings folder, library file, soname, status every stub returns)
LIBS = [
    ("driver", "libcuda.so", "libcuda.so.1", 34),       # CUDA_ERROR_STUB_LIBRARY
    ("nvrtc", "libnvrtc.so", "libnvrtc.so.13", 7),       # NVRTC_ERROR_BUILTIN_OPERATION_FAILURE
    ("cublas", "libcublas.so", "libcublas.so.13", 1),    # CUBLAS_STATUS_NOT_INITIALIZED
    ("cublaslt", "libcublasLt.so", "libcublasLt.so.13", 1),
    ("curand", "libcurand.so", "libcurand.so.10", 203),  # CURAND_STATUS_INITIALIZATION_FAILED
    ("nccl", "libnccl.so", "libnccl.so.2", 1),           # ncclUnhandledCudaError
]
fn = re.compile(r"^pub unsafe fn ([A-Za-z_][A-Za-z0-9_]*)\(", re.M)
for folder, lib, soname, status in LIBS:
    names = sorted(set(fn.findall(open(os.path.join(src, folder, "sys", "mod.rs")).read())))
    if not names:
        sys.exit(f"error: no functions found in cudarc's {folder} bindings")
    c = os.path.join(dest, lib + ".c")
    with open(c, "w") as out:
        out.write(f"/* Link stub for {soname}: every function returns {status}. Generated. */\n")
        for name in names:
            out.write(f"int {name}(void) {{ return {status}; }}\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", f"-Wl,-soname,{soname}", "-o",
                    os.path.join(dest, soname), c], check=True)
    os.remove(c)
    os.symlink(soname, os.path.join(dest, lib))
    print(f"stub {soname}: {len(names)} functions", file=sys.stderr)
PY
}

# write_nvcc_cached: bin/nvcc-cached (see the top), rewritten atomically on
# every run so that a change reaches toolkits installed before it.
write_nvcc_cached() {
    local dest="$PREFIX/bin/nvcc-cached"
    {
        echo '#!/usr/bin/env bash'
        echo '# nvcc with a result cache; written by .ci/candle-toolkit.sh, which explains it.'
        echo 'set -euo pipefail'
        printf 'real=%q\n' "$PREFIX/bin/nvcc"
        printf 'cache="${TP_ALLREDUCE_NVCC_CACHE:-%s}"\n' "$CACHE/nvcc"
        cat <<'WRAPPER'
argv=("$@") args=() out="" outdir="" mode="" src=""
for ((i = 0; i < ${#argv[@]}; i++)); do
    case "${argv[i]}" in
        -o) out="${argv[i + 1]:-}"; i=$((i + 1)); continue ;;
        --output-directory) outdir="${argv[i + 1]:-}"; i=$((i + 1)); continue ;;
        -c) mode=object ;;
        --ptx | -ptx) mode=ptx ;;
        *.cu) src="${argv[i]}" ;;
    esac
    args+=("${argv[i]}")
done
if [[ "$mode" == ptx && -z "$out" && -n "$outdir" && -n "$src" ]]; then
    out="$outdir/$(basename "${src%.cu}").ptx"
fi
# Not one .cu file compiled by a cargo build script: no caching.
if [[ -z "${CARGO_MANIFEST_DIR:-}" || -z "$mode" || -z "$src" || -z "$out" ]]; then
    exec "$real" "$@"
fi
key=$(
    {
        echo "nvcc-cached v1"
        cat "$(dirname "$real")/../.installed"
        printf '%s\n' "$mode" "${args[@]}"
        env | grep -E '^NVCC_(APPEND_FLAGS|PREPEND_FLAGS|CCBIN)=' | LC_ALL=C sort || true
        "${NVCC_CCBIN:-c++}" --version 2>/dev/null | head -n 1 || true
        cd "$CARGO_MANIFEST_DIR" &&
            find . -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.hpp' -o -name '*.inl' \) |
            LC_ALL=C sort | xargs -r -d '\n' sha256sum
    } | sha256sum | cut -c1-32
)
entry="$cache/$key"
if [[ -f "$entry/output" ]]; then
    cp "$entry/output" "$out"
    exit 0
fi
"$real" "$@"
mkdir -p "$cache"
tmp=$(mktemp -d "$cache/.tmp.XXXXXX")
chmod 755 "$tmp"
cp "$out" "$tmp/output"
# A concurrent build may have stored this key already: keep either copy.
mv -T "$tmp" "$entry" 2>/dev/null || rm -rf "$tmp"
WRAPPER
    } >"$dest.tmp"
    chmod +x "$dest.tmp"
    mv "$dest.tmp" "$dest"
}

install
write_nvcc_cached
if [[ "${1:-}" == "--env" ]]; then
    print_env
fi
