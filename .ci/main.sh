#!/usr/bin/env bash
# The main job (README): installs what the build needs, then runs the
# benchmark against NCCL on the visible GPUs. Without a GPU it says so and
# prints the model's plan for the default topology instead. Extra arguments
# go to `tp-allreduce bench` (e.g. --ranks-per-gpu 8 on a one-GPU machine).
#
#   bash .ci/main.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
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
exec target/release/tp-allreduce bench "$@"
