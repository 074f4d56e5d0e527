#!/usr/bin/env bash
# CI for the cargo feature `candle` (docs/CANDLE.md): installs the CUDA
# 13.0 build toolkit from NVIDIA's PyPI wheels (.ci/candle-toolkit.sh),
# then, in the combination an engine uses (`--no-default-features
# --features candle`: candle-core's cudarc picks the CUDA version, ours is
# off), lints the library, its unit tests and examples/candle_tp.rs, runs
# the unit tests (the candle ops' CPU-side tests and every other library
# unit test, now under cudarc's `dynamic-linking`, linked against the
# toolkit's stubs) and checks that the example links and starts. Last, the suite with the defaults
# plus `candle`: its candle GPU tests compile and skip here visibly.
#
#   bash .ci/candle.sh
#
# Every cargo command passes --target explicitly: host units (build scripts
# and their dependencies) are then the same for check and test builds, so
# candle-kernels' build script runs once per feature set. The two feature
# sets still differ on the host side (the tools' proc macros), so it runs
# twice; the toolkit's caching nvcc (NVCC, see candle-toolkit.sh) makes the
# second run's compiles cache hits: nvcc (most of a cold run's time)
# compiles each kernel once. The unit tests' log is kept for test.sh's
# summary (target/candle-unit-test.log, target/candle-test.log).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
started=$SECONDS
eval "$(bash .ci/candle-toolkit.sh --env)"
TARGET=$(rustc -vV | sed -n 's/^host: //p')
ENGINE=(--target "$TARGET" --no-default-features --features candle)
cargo clippy "${ENGINE[@]}" --lib --tests --examples -- -D warnings
echo "candle: clippy done after $((SECONDS - started)) s"
mkdir -p "${CARGO_TARGET_DIR:-target}"
cargo test "${ENGINE[@]}" --lib -- --test-threads=2 2>&1 | tee "${CARGO_TARGET_DIR:-target}/candle-unit-test.log"
echo "candle: unit tests done after $((SECONDS - started)) s"
# The example links the CUDA libraries; here it starts against the stubs
# and, outside a launcher, says how to start it.
cargo build "${ENGINE[@]}" --example candle_tp
if out=$("${CARGO_TARGET_DIR:-target}/$TARGET/debug/examples/candle_tp" 2>&1); then
  echo "error: candle_tp ran without a rank environment" >&2; exit 1
fi
grep -q "tp-allreduce launch" <<<"$out" || { echo "error: candle_tp did not start: $out" >&2; exit 1; }
# The defaults plus candle (our version feature on, which cudarc prefers
# over the build system's): the suite with the candle GPU tests.
cargo clippy --target "$TARGET" --features candle --test suite -- -D warnings
log="${CARGO_TARGET_DIR:-target}/candle-test.log"
cargo test --target "$TARGET" --features candle --test suite -- candle --test-threads=2 2>&1 | tee "$log"
# The candle GPU tests skip without a GPU; say how many did.
echo "candle GPU tests that skipped on this machine: $(bash .ci/count-skips "$log")"
echo "candle CI step: $((SECONDS - started)) s"
