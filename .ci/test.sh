#!/usr/bin/env bash
# The test command (README): installs what the tests need, then runs
# formatting, lints, the whole test suite, the Python package's tests, the
# engine harness's CPU part (SGLang's and vLLM's real packages; .ci/engines.sh)
# and, last, the `candle` feature's CI. On a machine without a GPU the GPU tests
# print "skipped: no CUDA device" and are counted; on a GPU machine set
# TP_ALLREDUCE_REQUIRE_GPU=1 to make skips fail.
#
#   bash .ci/test.sh                               # everything CI runs
#   TP_ALLREDUCE_SKIP_CANDLE=1 bash .ci/test.sh    # local: all but the candle step
#   TP_ALLREDUCE_SKIP_ENGINES=1 bash .ci/test.sh   # local: all but the engines step
#                                                  # (its base venv is ~5 GB)
#
# Each step says when it starts, prints a line every 30 s while it runs and
# its time when done; the run ends with a table of the steps' times and one
# summary line: tests passed / failed / skipped for want of a GPU, the Rust
# tests (every cargo test run, the candle step's included) and the Python
# tests apart, the engine dry run's checks passed / failed / not run (or
# why it has no count: skipped, not reached), then the wall and CPU time.
#
# Time goes into compiling. So that each crate graph is built as few times
# as possible: clippy and `cargo doc` share the check build; one test-profile
# build (`cargo test --no-run`) compiles and links the tests, examples and
# benches, and the test step runs those tests; the Python wheel's
# build uses the same target directory and profile, so it reuses that
# build's dependencies; the PTX comes from build.rs's cache (.cache/ptx,
# built once per change of the kernels' code). Benches are built with the
# test profile here (that they compile and link is the check); main.sh
# builds the release binary.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
TARGET_DIR="$CARGO_TARGET_DIR"
mkdir -p "$TARGET_DIR"
# Line tables are enough for a test failure's backtrace; full debug info
# makes every test and example binary slower to link and 2-3x larger.
export CARGO_PROFILE_DEV_DEBUG="${CARGO_PROFILE_DEV_DEBUG:-line-tables-only}"
if [[ "${CI:-}" == true ]]; then
    # A fresh clone builds everything once: incremental state is only cost.
    export CARGO_INCREMENTAL=0
fi

started=$SECONDS
timings=()
# CPU seconds this script's finished children used so far (Linux /proc; 0
# elsewhere): with the wall time it shows how busy the machine was.
tick=$(getconf CLK_TCK 2>/dev/null || echo 100)
cpu_seconds() {
    local stat
    stat=$(cat /proc/$$/stat 2>/dev/null) || { echo 0; return; }
    stat=${stat##*) }
    # After the command name: state is field 3, cutime and cstime 16 and 17.
    read -r -a stat <<<"$stat"
    echo $(((stat[13] + stat[14]) / tick))
}
heartbeat=""
stop_heartbeat() {
    if [[ -n "$heartbeat" ]]; then
        kill "$heartbeat" 2>/dev/null || true
        wait "$heartbeat" 2>/dev/null || true
        heartbeat=""
    fi
}
# step NAME COMMAND...: runs COMMAND, saying when it starts, every 30 s
# while it runs (cargo prints nothing while one large crate compiles) and
# how long it took.
step() {
    local name="$1" t0=$SECONDS c0
    c0=$(cpu_seconds)
    shift
    echo "==> [$name] started at $(date +%T) (${SECONDS}s into the run): $*"
    (
        while sleep 30; do echo "    [$name] still running ($((SECONDS - t0)) s)"; done
    ) &
    heartbeat=$!
    # In the background so that `set -e` holds inside COMMAND (a function
    # called as `f || ...` would run with it off).
    local rc=0
    "$@" &
    wait $! || rc=$?
    stop_heartbeat
    local took="$((SECONDS - t0)) s (CPU $(($(cpu_seconds) - c0)) s)"
    timings+=("$(printf '%-7s %-22s %s' "$name" "$took" "$([[ $rc == 0 ]] && echo ok || echo "FAILED (exit $rc)")")")
    if ((rc != 0)); then
        echo "==> [$name] FAILED after $took (exit $rc)"
        exit "$rc"
    fi
    echo "==> [$name] done in $took"
}

rust_logs=()
python_log="$TARGET_DIR/pytest.log"
engines_log="$TARGET_DIR/engines.log"
engines_state="not reached"
rm -f "$python_log" "$engines_log" "$TARGET_DIR/test.log" "$TARGET_DIR/candle-test.log" "$TARGET_DIR/candle-unit-test.log"
summary() {
    local rc=$?
    stop_heartbeat
    echo
    echo "==> step times (2-core reference machine: see README, \"Two commands\")"
    printf '    %s\n' "${timings[@]}"
    local rust=(0 0 0) python=(0 0 0) logs=()
    for log in "${rust_logs[@]}"; do [[ -f "$log" ]] && logs+=("$log"); done
    if ((${#logs[@]})); then
        read -r -a rust < <(bash .ci/count-skips --summary "${logs[@]}")
    fi
    if [[ -f "$python_log" ]]; then
        # pytest's last line: "==== 40 passed, 12 skipped in 3.2s ===="
        local line
        line=$(grep -aE '^=+ .* in [0-9.]+s' "$python_log" | tail -n 1 || true)
        count() { grep -oE "[0-9]+ $1" <<<"$line" | head -n 1 | cut -d' ' -f1; }
        local p f e s
        p=$(count passed) f=$(count failed) e=$(count error) s=$(count skipped)
        python=("${p:-0}" $((${f:-0} + ${e:-0})) "${s:-0}")
    fi
    # The engine dry run's count, run_checks' "35 passed, 0 failed, 0 not
    # run"; without one it did not run to its end: say why, count nothing.
    local engines="$engines_state"
    if [[ -f "$engines_log" ]]; then
        local n
        n=$(grep -aE '^[0-9]+ passed, [0-9]+ failed, [0-9]+ not run$' "$engines_log" | tail -n 1 || true)
        if [[ -n "$n" ]]; then
            engines="${n/ passed/ checks passed}"
        else
            engines="FAILED before its checks' count (log: $engines_log)"
        fi
    fi
    local total=$((SECONDS - started)) cpu
    cpu=$(cpu_seconds)
    printf 'SUMMARY %s: Rust tests %d passed, %d failed, %d skipped (no CUDA device) | Python tests %d passed, %d failed, %d skipped (no PyTorch/GPU) | engine dry run %s | %dm%02ds (CPU %dm%02ds)\n' \
        "$([[ $rc == 0 ]] && echo ok || echo FAILED)" "${rust[@]}" "${python[@]}" "$engines" \
        $((total / 60)) $((total % 60)) $((cpu / 60)) $((cpu % 60))
    exit "$rc"
}
trap summary EXIT

# A cold run needs ~11 GB of disk (target/ ~4 GB, .cache/ ~6 GB, 5 of them
# the engines step's base venv); a full disk fails a build step with "No
# space left on device", so say up front what is free.
df -h . | tail -n 1 | awk '{print "disk free here: " $4 " (a cold run needs about 11 GB)"}'

step tools bash .ci/tools.sh
# The PTX checks must really run: ptxas present, PTX rebuilt from source.
export TP_ALLREDUCE_REQUIRE_PTXAS=1 TP_ALLREDUCE_REQUIRE_PTX_BUILD=1
step fmt cargo fmt --all -- --check
step clippy cargo clippy --workspace --all-targets -- -D warnings
# The library alone (without the tool's crate) must build.
step lib cargo check -p tp-allreduce --lib --no-default-features --features cuda-version-13000
# Documentation builds with every doc link resolved.
step doc env RUSTDOCFLAGS="-D warnings" cargo doc --no-deps
# Tests and examples (as programs), then the benches, compile and link
# (test profile) ...
build_tests() {
    cargo test --workspace --no-run
    cargo test --workspace --benches --no-run
}
step build build_tests
# ... and the tests run (unit, integration and doc tests).
# TPAR_RDV_FUZZ=1: the rendezvous fuzz (up to 240 s; the default `cargo
# test` skips it visibly) runs here, once; the candle step's unit-test run
# skips it.
run_tests() {
    TPAR_RDV_FUZZ=1 cargo test --workspace -- --test-threads=2 2>&1 | tee "$TARGET_DIR/test.log"
}
rust_logs+=("$TARGET_DIR/test.log")
step test run_tests

# Python package (python/): build the wheel (dev profile, this target
# directory: it reuses the dependencies built above), install it with pytest
# into a venv, run its tests. No torch or GPU here: those tests skip visibly
# (listed by -rs); python/run-gpu-checks.sh runs them on a GPU machine.
python_tests() {
    rm -rf .cache/python-wheel
    bash python/build-wheel.sh .cache/python-wheel --debug
    python3 -m venv .cache/python-venv
    .cache/python-venv/bin/pip install --quiet --disable-pip-version-check pytest==9.0.3
    .cache/python-venv/bin/pip install --quiet --disable-pip-version-check --force-reinstall --no-deps \
        .cache/python-wheel/tp_allreduce-*.whl
    .cache/python-venv/bin/python -m pytest python/tests -rs -p no:cacheprovider 2>&1 | tee "$python_log"
}
step python python_tests

# The engine harness's CPU part (.ci/engines.sh; python/engine_checks/
# README.md, "Dry run"): SGLang's and vLLM's real packages, trimmed as for
# the GPU machine, pip-installed with the wheel just built (its .pth hook,
# vLLM's entry-point plugin) on torch 2.11, then run-on-gpu.sh --dry-run:
# the checked path's imports with CUDA stood in, each engine's distributed
# setup, dispatch and teardown on CPU (SGLang; vLLM 0.33.0 and 0.34.0).
# ~4.5 minutes cold on 2 cores (a 5 GB venv from PyPI into .cache/engines),
# ~3.5 once cached. Locally
# TP_ALLREDUCE_SKIP_ENGINES=1 leaves it out; CI always runs it.
if [[ "${TP_ALLREDUCE_SKIP_ENGINES:-}" == 1 && "${CI:-}" != true ]]; then
    echo "==> [engines] SKIPPED (TP_ALLREDUCE_SKIP_ENGINES=1): CI runs it; locally: bash .ci/engines.sh"
    engines_state="skipped (TP_ALLREDUCE_SKIP_ENGINES=1)"
    timings+=("$(printf '%-7s %-22s %s' engines - "skipped (TP_ALLREDUCE_SKIP_ENGINES=1)")")
else
    if [[ "${TP_ALLREDUCE_SKIP_ENGINES:-}" == 1 ]]; then
        echo "==> [engines] TP_ALLREDUCE_SKIP_ENGINES=1 ignored: CI=true runs every step"
    fi
    run_engines() {
        bash .ci/engines.sh .cache/python-wheel 2>&1 | tee "$engines_log"
    }
    step engines run_engines
fi

# The cargo feature `candle` (docs/CANDLE.md): the CUDA toolkit from PyPI
# wheels, lints and tests in the engine's feature combination. The slowest
# step (nvcc compiles candle's kernels on its first run), so it comes last;
# locally TP_ALLREDUCE_SKIP_CANDLE=1 leaves it out. CI always runs it.
if [[ "${TP_ALLREDUCE_SKIP_CANDLE:-}" == 1 && "${CI:-}" != true ]]; then
    echo "==> [candle] SKIPPED (TP_ALLREDUCE_SKIP_CANDLE=1): CI runs it; locally: bash .ci/candle.sh"
    timings+=("$(printf '%-7s %-22s %s' candle - "skipped (TP_ALLREDUCE_SKIP_CANDLE=1)")")
else
    if [[ "${TP_ALLREDUCE_SKIP_CANDLE:-}" == 1 ]]; then
        echo "==> [candle] TP_ALLREDUCE_SKIP_CANDLE=1 ignored: CI=true runs every step"
    fi
    rust_logs+=("$TARGET_DIR/candle-unit-test.log" "$TARGET_DIR/candle-test.log")
    step candle bash .ci/candle.sh
fi
