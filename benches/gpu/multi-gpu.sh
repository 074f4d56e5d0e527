#!/usr/bin/env bash
# The multi-GPU run as one script: correctness on 2, 4
# and 8 GPUs (one process per GPU), the SIGKILL fault test across GPUs,
# topology + tuning, the benchmark against NCCL in the same run (graph
# replay, 1 KB .. 64 MB, bf16, verify pass), and host-staged vs NCCL with
# NCCL_P2P_DISABLE=1.
#
# Build here, run there (the GPU machine has no Rust toolchain):
#   cargo build --release && mkdir -p .dev && cp target/release/tp-allreduce .dev/ && strip .dev/tp-allreduce
#   then on the GPU machine, from the repository root:  OUT=<results dir> bash benches/gpu/multi-gpu.sh
# Keeps NVLink multicast off (the machines require it).
set -uo pipefail
B=${TP_ALLREDUCE_BIN:-.dev/tp-allreduce}
OUT=${OUT:-results/multi-gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_DEVICE_MAX_CONNECTIONS=8 TP_ALLREDUCE_TIMEOUT_MS=5000
# cudarc loads libnccl.so; the NCCL wheel ships libnccl.so.2.
if NCCL_DIR=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null); then
  mkdir -p /tmp/nccl && ln -sf "$NCCL_DIR/libnccl.so.2" /tmp/nccl/libnccl.so && export LD_LIBRARY_PATH=/tmp/nccl:${LD_LIBRARY_PATH:-}
fi
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
LOG=$OUT/log.txt
run() { echo "=== $*" | tee -a "$LOG"; timeout 560 "$@" 2>&1 | tee -a "$LOG" | grep -vE '^\[[0-9]+/' | tail -40; echo "exit ${PIPESTATUS[0]}" | tee -a "$LOG"; }
nvidia-smi topo -m > "$OUT/nvidia-smi-topo.txt" 2>&1
run "$B" topo
"$B" topo --json > "$OUT/topo.json"
for n in 2 4 8; do
  [ "$n" -le "$GPUS" ] || continue
  gpus=$(seq -s, 0 $((n - 1)))
  islands=""; [ "$n" -ge 4 ] && islands="--island-size $((n / 2))"
  # 1. correctness, one process per GPU, eager + graph, every algorithm x dtype x sizes
  run "$B" launch -n "$n" --gpus "$gpus" --timeout 500 -- "$B" selftest $islands
  # 2. tuning table for this world size
  run "$B" tune --gpus "$gpus" $islands --out "$OUT/tuning-w$n.toml"
  # 3. benchmark against NCCL, one process per GPU, graph replay, with the tuned table
  TP_ALLREDUCE_TUNING_FILE="$OUT/tuning-w$n.toml" run "$B" bench --processes --gpus "$gpus" $islands --algorithms all --out "$OUT/bench-w$n"
done
# The fault test across GPUs.
[ "$GPUS" -ge 4 ] && run "$B" launch -n 4 --gpus 0,1,2,3 --grace 30 -- "$B" selftest --quick --fault 2:7
# 4. host-staged (real PCIe through host memory) vs NCCL without P2P, 4 KB .. 1 MB.
[ "$GPUS" -ge 2 ] && NCCL_P2P_DISABLE=1 TP_ALLREDUCE_TRANSPORT=host-staged \
  run "$B" bench --processes --gpus "$(seq -s, 0 $((GPUS - 1)))" --algorithms auto,one-shot-push,two-shot-push,nccl \
  --sizes 4K,16K,42K,64K,256K,1M --out "$OUT/bench-host-staged"
echo "done: $OUT"
