#!/usr/bin/env bash
# The engine harness's CPU part (python/engine_checks/README.md, "Dry run"):
# the real SGLang 0.5.23, vLLM 0.33.0 and vLLM 0.34.0 Python packages, trimmed and
# carried as for the GPU machine, installed with tp-allreduce's wheel by pip
# (its .pth hook and vLLM's entry-point plugin active as users get them),
# with the listed stubs; then `run-on-gpu.sh WHEEL_DIR --dry-run`: every
# module of the checked path imported with CUDA stood in, each engine's
# distributed setup, dispatch and teardown on CPU over gloo. No GPU needed.
#
#   bash .ci/engines.sh [WHEEL_DIR]
#
# WHEEL_DIR: a folder with tp-allreduce's wheel (test.sh passes the one its
# Python step built); without it the wheel is built here (dev profile) into
# .cache/engines/wheel.
#
# What it installs, each cached under .cache/engines/ (a rerun reuses it):
# * prep-X.Y/: prepare.py's carry for this machine's Python X.Y (pinned
#   PyPI wheels, the engine wheels trimmed); the engine wheels as downloaded
#   are kept (~360 MB) so a rerun does not download them again;
# * base-venv-X.Y/: the BASE_PYTHON of the dry run, standing in for the GPU
#   machine's /opt/torch/.venv: torch 2.11 (PyPI's CUDA build: PyTorch's
#   CPU-only index is not reachable here) and the GPU image's packages the
#   path imports (python/engine_checks/dry-run-base.txt, installed with
#   --no-deps: exactly that list). ~4.6 GiB; built once per change of that
#   list or of the Python (a stamp file says which), the download (~3.7 GB)
#   not kept: the venv is the cache.
# The dry run's logs and per-rank JSON go to .cache/engines/dry-run/ (emptied
# first). Every stage is bounded with `timeout`; any failure (a download, an
# install, a check that fails or does not report) exits non-zero. The last
# line of a run that got as far as the checks is run_checks' count,
# "N passed, N failed, N not run" (test.sh's summary reads it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
PYTHON="${PYTHON:-python3}"
CACHE="$ROOT/.cache/engines"
# pip's own cache would keep a second copy of every download outside the
# repository: what is worth keeping is kept under $CACHE instead.
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
started=$SECONDS
say() { echo "engines: $* ($((SECONDS - started)) s)"; }
mkdir -p "$CACHE"

# 1. tp-allreduce's wheel.
if [[ $# -ge 1 ]]; then
    wheels="$(cd "$1" && pwd)"
else
    wheels="$CACHE/wheel"
    rm -rf "$wheels"
    say "building tp-allreduce's wheel (dev profile) into $wheels"
    timeout 1800 bash python/build-wheel.sh "$wheels" --debug
fi
mapfile -t ours < <(compgen -G "$wheels/tp_allreduce-*.whl" || true)
if [[ ${#ours[@]} -ne 1 ]]; then
    echo "engines: error: want exactly one tp_allreduce wheel in $wheels, found ${#ours[@]}" >&2
    exit 1
fi
say "tp-allreduce wheel: ${ours[0]}"

# 2. The carry, for this machine's Python (the GPU machine's is 3.12; the
# same pinned versions).
prep="$CACHE/prep-$pyver"
say "preparing the carry for Python $pyver (prepare.py: pinned wheels from PyPI, engine wheels trimmed)"
timeout 900 "$PYTHON" python/engine_checks/prepare.py --python-version "$pyver" --out "$prep" --keep-downloads
say "carry ready: $(sed -n 's/.* total (\([^,]*\),.*/\1/p' "$prep/MANIFEST.txt") in $prep/carry"

# 3. BASE_PYTHON: torch 2.11 and the GPU image's packages the path imports.
base="$CACHE/base-venv-$pyver"
base_list=python/engine_checks/dry-run-base.txt
want="$("$PYTHON" -c 'import sys; print(sys.version.split()[0], sys.base_prefix)') $(sha256sum "$base_list" | cut -d' ' -f1)"
if [[ -f "$base/.tp-allreduce-stamp" && "$(cat "$base/.tp-allreduce-stamp")" == "$want" ]]; then
    say "base venv: reusing $base (same $base_list, same Python)"
else
    rm -rf "$base"
    say "base venv: installing $base_list into $base (torch 2.11 with its CUDA libraries, ~3.7 GB from PyPI; about a minute)"
    "$PYTHON" -m venv "$base"
    timeout 1500 "$base/bin/python" -m pip install --quiet --no-cache-dir --no-deps -r "$base_list"
    echo "$want" >"$base/.tp-allreduce-stamp"
    say "base venv installed ($(du -sh "$base" | cut -f1))"
fi
# torch must import here without a GPU, in the version the GPU machine has.
timeout 300 "$base/bin/python" - <<'PY'
import torch
assert torch.__version__.startswith("2.11."), torch.__version__
print(f"engines: base venv: torch {torch.__version__} (CUDA build {torch.version.cuda}), "
      f"CUDA available: {torch.cuda.is_available()} (the dry run stands it in)")
PY

# 4. The dry run: the same venvs as on the GPU machine (pip install of the
# carry and of our wheel), then run_checks --dry-run.
out="$CACHE/dry-run"
rm -rf "$out"
mkdir -p "$out"
say "dry run: run-on-gpu.sh --dry-run (logs and JSON: $out)"
rc=0
BASE_PYTHON="$base/bin/python" CARRY="$prep/carry" OUT="$out" \
    timeout -k 30 1500 bash python/engine_checks/run-on-gpu.sh "$wheels" --dry-run || rc=$?
if [[ $rc -eq 124 ]]; then
    echo "engines: error: the dry run ran past 1500 s (killed)" >&2
fi
# run_checks' count ("65 passed, 0 failed, 0 not run"); none means the checks
# never ran to the end: a failure whatever the exit status.
count=$(grep -aE '^[0-9]+ passed, [0-9]+ failed, [0-9]+ not run$' "$out/run-on-gpu.log" | tail -n 1 || true)
if [[ -z "$count" ]]; then
    echo "engines: error: the dry run printed no count of its checks (log: $out/run-on-gpu.log)" >&2
    ((rc != 0)) || rc=1
elif [[ "$count" == 0\ passed* ]]; then
    echo "engines: error: the dry run passed no check" >&2
    ((rc != 0)) || rc=1
fi
if ((rc != 0)); then
    echo "engines: FAILED (exit $rc) after $((SECONDS - started)) s; logs: $out" >&2
    exit "$rc"
fi
say "dry run passed"
echo "$count"
