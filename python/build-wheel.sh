#!/usr/bin/env bash
# Builds the tp-allreduce Python wheel (abi3: one wheel for CPython >= 3.9,
# x86_64 Linux, tag manylinux_2_34 = glibc 2.34 or newer) into OUT_DIR.
#
#   bash python/build-wheel.sh OUT_DIR [--debug] [--with-pytest]
#
#   --debug        dev profile (faster build; CI uses it for the CPU tests)
#   --with-pytest  also download pytest and its dependencies (wheels for
#                  CPython 3.12) into OUT_DIR, for machines without network
#                  (run-gpu-checks.sh installs from OUT_DIR)
#
# maturin (pinned below) is installed from PyPI into .cache/maturin-venv.
# The kernels' PTX follows build.rs's rules (TP_ALLREDUCE_BUILD_PTX: built
# from source when the nightly toolchain is present, else the committed PTX).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MATURIN_VERSION="1.16.0"
PYTEST_VERSION="9.0.3"
PYTHON="${PYTHON:-python3}"

out="${1:?usage: build-wheel.sh OUT_DIR [--debug] [--with-pytest]}"
shift
profile="--release"
with_pytest=0
for arg in "$@"; do
    case "$arg" in
        --debug) profile="" ;;
        --with-pytest) with_pytest=1 ;;
        *) echo "build-wheel.sh: unknown argument $arg" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
out="$(cd "$out" && pwd)"

venv="$ROOT/.cache/maturin-venv"
if ! "$venv/bin/maturin" --version 2>/dev/null | grep -qx "maturin $MATURIN_VERSION"; then
    "$PYTHON" -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "maturin==$MATURIN_VERSION"
fi

# manylinux_2_34: this build machine has glibc 2.36; maturin checks that the
# extension needs no symbol newer than 2.34 (it only links libc: libcuda is
# loaded at run time), and pip accepts the tag on any glibc >= 2.34.
# shellcheck disable=SC2086
"$venv/bin/maturin" build $profile \
    --manifest-path "$ROOT/python/Cargo.toml" \
    --compatibility manylinux_2_34 \
    --out "$out"

if [[ "$with_pytest" == 1 ]]; then
    "$venv/bin/pip" download --quiet --disable-pip-version-check --only-binary=:all: \
        --python-version 3.12 --platform manylinux_2_34_x86_64 --implementation cp \
        --dest "$out" "pytest==$PYTEST_VERSION"
fi
ls -1 "$out"
