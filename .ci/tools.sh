#!/usr/bin/env bash
# Installs the CUDA tools the PTX checks and `tp-allreduce inspect` use into
# <repo>/.cache/cuda-tools/bin (no root, no system install), and the nightly
# rust-src component build.rs needs to compile kernels-rs. Idempotent: a tool
# already installed at the pinned version is left alone.
#
#   bash .ci/tools.sh
#
# ptxas and nvdisasm come from NVIDIA's PyPI wheels (the wheels are plain zip
# files; they are extracted with python's zipfile since unzip may be absent).
set -euo pipefail

# Pinned versions (the wheel names on PyPI).
NVCC_WHEEL_PKG="nvidia-cuda-nvcc"
NVCC_WHEEL_VERSION="13.0.88"
NVCC_WHEEL_PTXAS="nvidia/cu13/bin/ptxas"
NVDISASM_WHEEL_PKG="nvidia-cuda-nvdisasm"
NVDISASM_WHEEL_VERSION="13.2.86"
NVDISASM_WHEEL_NVDISASM="nvidia/cu13/bin/nvdisasm"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$ROOT/.cache"
WHEELS="$CACHE/wheels"
BIN="$CACHE/cuda-tools/bin"
PYTHON="${PYTHON:-python3}"
mkdir -p "$WHEELS" "$BIN"

# install_tool NAME PKG VERSION MEMBER: puts MEMBER of PKG==VERSION's wheel at
# $BIN/NAME, recording the version in $BIN/NAME.version.
install_tool() {
    local name="$1" pkg="$2" version="$3" member="$4"
    local dest="$BIN/$name" stamp="$BIN/$name.version"
    if [[ -x "$dest" && -f "$stamp" && "$(cat "$stamp")" == "$pkg==$version" ]]; then
        echo "$name: already installed ($pkg==$version)"
        return
    fi
    local wheel_glob="${pkg//-/_}-${version}-*.whl"
    # shellcheck disable=SC2086
    if ! compgen -G "$WHEELS/$wheel_glob" >/dev/null; then
        echo "$name: downloading $pkg==$version"
        "$PYTHON" -m pip download --no-deps --only-binary=:all: --disable-pip-version-check \
            "$pkg==$version" -d "$WHEELS"
    fi
    local wheel
    wheel="$(compgen -G "$WHEELS/$wheel_glob" | head -n1)"
    if [[ -z "$wheel" ]]; then
        echo "error: no wheel matching $wheel_glob in $WHEELS after download" >&2
        exit 1
    fi
    echo "$name: extracting $member from $(basename "$wheel")"
    "$PYTHON" - "$wheel" "$member" "$dest.tmp" <<'PY'
import shutil, sys, zipfile
wheel, member, dest = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    try:
        src = z.open(member)
    except KeyError:
        sys.exit(f"error: {member} not found in {wheel}")
    with src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out)
PY
    chmod +x "$dest.tmp"
    mv "$dest.tmp" "$dest"
    echo "$pkg==$version" > "$stamp"
}

install_tool ptxas "$NVCC_WHEEL_PKG" "$NVCC_WHEEL_VERSION" "$NVCC_WHEEL_PTXAS"
install_tool nvdisasm "$NVDISASM_WHEEL_PKG" "$NVDISASM_WHEEL_VERSION" "$NVDISASM_WHEEL_NVDISASM"

# build.rs compiles core from source for nvptx (-Zbuild-std), which needs rust-src.
if command -v rustup >/dev/null; then
    if rustup component list --toolchain nightly --installed 2>/dev/null | grep -q '^rust-src'; then
        echo "rust-src: already installed for nightly"
    else
        rustup component add rust-src --toolchain nightly
    fi
else
    echo "warning: rustup not found; build.rs will use the committed PTX (kernels-rs/ptx)" >&2
fi

echo
echo "$BIN/ptxas:"
"$BIN/ptxas" --version | tail -n 2
echo "$BIN/nvdisasm:"
"$BIN/nvdisasm" --version | tail -n 2
