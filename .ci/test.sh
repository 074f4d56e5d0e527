#!/usr/bin/env bash
# The test command (README): installs what the tests need, then runs
# formatting, lints and the whole test suite. On a machine without a GPU the
# GPU tests print "skipped: no CUDA device" and the count is reported at the
# end; on a GPU machine set TP_ALLREDUCE_REQUIRE_GPU=1 to make skips fail.
#
#   bash .ci/test.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The whole run needs ~10 GB of disk (PTX for four architectures, the
# wheel, the candle feature's build); a full disk fails a build step with
# "No space left on device", so say up front what is free.
df -h . | tail -n 1 | awk '{print "disk free here: " $4}'
bash .ci/tools.sh
# The PTX checks must really run: ptxas present, PTX rebuilt from source.
export TP_ALLREDUCE_REQUIRE_PTXAS=1 TP_ALLREDUCE_REQUIRE_PTX_BUILD=1
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo bench --no-run --quiet
# The examples and the library alone (without the tool's crate) must build.
cargo build --examples --quiet
cargo check -p tp-allreduce --lib --no-default-features --features cuda-version-13000 --quiet
# Documentation builds with every doc link resolved.
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --quiet
mkdir -p target
set -o pipefail
cargo test --workspace -- --test-threads=2 2>&1 | tee target/test.log
# Distinct tests that skipped: the name in parentheses ends each skip line
# ("skipped: no CUDA device (name)"); a test may print several such lines.
skipped=$(bash .ci/count-skips target/test.log)
echo "tests passed; tests that skipped on this machine: ${skipped} (the 'skipped:' lines above)"

# Python package (python/): build the wheel (dev profile), install it with
# pytest into a venv, run its tests. No torch or GPU here: those tests skip
# visibly (listed by -rs); python/run-gpu-checks.sh runs them on a GPU machine.
rm -rf .cache/python-wheel
bash python/build-wheel.sh .cache/python-wheel --debug
python3 -m venv .cache/python-venv
.cache/python-venv/bin/pip install --quiet --disable-pip-version-check pytest==9.0.3
.cache/python-venv/bin/pip install --quiet --disable-pip-version-check --force-reinstall --no-deps .cache/python-wheel/tp_allreduce-*.whl
.cache/python-venv/bin/python -m pytest python/tests -rs -p no:cacheprovider
bash .ci/candle.sh  # the cargo feature `candle` (docs/CANDLE.md): CUDA toolkit from PyPI wheels, lints, tests
