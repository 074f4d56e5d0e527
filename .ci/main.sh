#!/usr/bin/env bash
# The main job (README): installs what the build needs, then runs the
# benchmark against NCCL on the visible GPUs. Without a GPU it says so and
# prints the model's plan for the default topology instead. Extra arguments
# go to `tp-allreduce bench` (e.g. --ranks-per-gpu 8 on a one-GPU machine).
#
#   bash .ci/main.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Said first and last: without a GPU nothing is measured, and the rest of
# the output (tools, the build, the plan) is long.
no_gpu_note="no GPU here: nothing is measured; after the build this prints the cost model's plan for the default topology instead (run this on a machine with NVIDIA GPUs to measure)"
if ! { command -v nvidia-smi > /dev/null && nvidia-smi -L 2> /dev/null | grep -q '^GPU '; }; then
  echo "main.sh: $no_gpu_note" >&2
fi
bash .ci/tools.sh
# cudarc loads libnccl.so; NCCL wheels ship libnccl.so.2: link it if found.
if python3 -c "import nvidia.nccl" 2>/dev/null; then
  nccl_lib=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))")
  mkdir -p .cache/nccl && ln -sf "$nccl_lib/libnccl.so.2" .cache/nccl/libnccl.so
  export LD_LIBRARY_PATH="$PWD/.cache/nccl:${LD_LIBRARY_PATH:-}"
fi
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
# Say what happens: the first release build takes a few minutes; then how
# long the build took.
echo "main.sh: building tp-allreduce (release; the first build takes a few minutes, cargo's progress follows)" >&2
built=$SECONDS
cargo build --release --bin tp-allreduce
echo "main.sh: built in $((SECONDS - built)) s" >&2
echo "main.sh: tp-allreduce bench $*" >&2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
target/release/tp-allreduce bench "$@" | tee "$log"
# The binary decides (it asks the CUDA driver): its plan starts "no CUDA device:".
if grep -q '^no CUDA device:' "$log"; then
  echo "main.sh: done: no CUDA device, so the table above is the cost model's plan, not a measurement; run this on a machine with NVIDIA GPUs to measure" >&2
else
  echo "main.sh: done: measured on this machine's GPUs (table above)" >&2
fi
