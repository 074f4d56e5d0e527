#!/usr/bin/env bash
# Builds what the scripts of benches/gpu/ carry to a GPU machine that has no
# Rust toolchain:
#   .dev/tp-allreduce       release CLI of this tree (stripped)
#   .dev/suite              the integration-test binary (`cargo test --release --no-run`, stripped)
#   .dev/tp-allreduce-old   only with OLD_REV=<rev>: the release CLI of that revision, to compare
#                           against, built from `git archive` in a temporary folder with its own
#                           target dir (an existing one is kept unless REBUILD_OLD=1)
#   .peers/flashinfer-pcie  only with PEERS_SRC=<folder>: a copy of that folder, for
#                           peer-shared-gpu.py (kept when already there)
# and checks that .dev and .peers together stay under 60 MiB (the device
# machine takes at most 64 MiB of carried files).
#
#   bash benches/gpu/build-dev.sh
# then copy .dev to the GPU machine and run e.g. `OUT=<dir> bash benches/gpu/vs-peers.sh`
# from the repository root there (its FlashInfer step runs FlashInfer's pip
# package: benches/gpu/flashinfer_peer.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OLD_REV=${OLD_REV:-none}
mkdir -p .dev .peers

cargo build --release --bin tp-allreduce
cp target/release/tp-allreduce .dev/tp-allreduce
cargo test --release --no-run --test suite
suite=$(cargo test --release --no-run --test suite --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "suite":
        print(m["executable"])' | tail -1)
[ -x "$suite" ] || { echo "test binary not found (cargo test --release --no-run --test suite)" >&2; exit 1; }
cp "$suite" .dev/suite

if [ "$OLD_REV" != none ] && { [ ! -x .dev/tp-allreduce-old ] || [ "${REBUILD_OLD:-0}" = 1 ]; }; then
  src=$(mktemp -d /tmp/tp-allreduce-old.XXXXXX)
  git archive "$OLD_REV" | tar -x -C "$src"
  # The old tree builds its PTX from source too (or embeds its committed PTX).
  (cd "$src" && CARGO_TARGET_DIR="$src/target" cargo build --release --bin tp-allreduce)
  cp "$src/target/release/tp-allreduce" .dev/tp-allreduce-old
  rm -rf "$src"
fi
strip .dev/tp-allreduce .dev/suite
[ -x .dev/tp-allreduce-old ] && strip .dev/tp-allreduce-old

if [ -n "${PEERS_SRC:-}" ] && [ "$PEERS_SRC" != none ] && [ ! -f .peers/flashinfer-pcie/run_peer_bench.py ]; then
  [ -f "$PEERS_SRC/run_peer_bench.py" ] || { echo "PEERS_SRC=$PEERS_SRC holds no run_peer_bench.py" >&2; exit 1; }
  cp -r "$PEERS_SRC" .peers/flashinfer-pcie && chmod -R u+w .peers/flashinfer-pcie
fi
rm -rf .peers/flashinfer-pcie/__pycache__

total=$(du -sb .dev .peers | awk '{s += $1} END {print s}')
ls -l .dev
echo ".dev + .peers: $((total / 1024 / 1024)) MiB"
if [ "$total" -ge $((60 * 1024 * 1024)) ]; then
  echo "too large to carry (limit 60 MiB)" >&2
  exit 1
fi
