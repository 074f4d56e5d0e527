#!/bin/bash
# Issue 8 on nvidia-h200-x2, in the device budget left (~4 min): 2-GPU subset of .ci/multi-gpu.sh.
B=${TP_ALLREDUCE_BIN:-.dev/tp-allreduce}; L=$OUT/log.txt
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_DEVICE_MAX_CONNECTIONS=8 TP_ALLREDUCE_TIMEOUT_MS=5000
NCCL_DIR=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
mkdir -p /tmp/nccl && ln -sf $NCCL_DIR/libnccl.so.2 /tmp/nccl/libnccl.so && export LD_LIBRARY_PATH=/tmp/nccl:$LD_LIBRARY_PATH
run() { t=$1; shift; echo "=== [$(date +%T)] $*" >> $L; timeout $t "$@" >> $L 2>&1; echo "exit $? [$(date +%T)]" >> $L; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpus.txt 2>&1; nvidia-smi topo -m > $OUT/nvidia-smi-topo.txt 2>&1
run 10 $B topo; $B topo --json > $OUT/topo.json 2>>$L
run 45 $B launch -n 2 --gpus 0,1 --timeout 44 -- $B selftest
run 70 $B bench --processes --gpus 0,1 --out $OUT/bench-w2
run 20 $B launch -n 2 --gpus 0,1 --grace 10 -- $B selftest --quick --fault 1:7
NCCL_P2P_DISABLE=1 TP_ALLREDUCE_TRANSPORT=host-staged run 30 $B bench --processes --gpus 0,1 --algorithms auto,one-shot-push,two-shot-push,nccl --sizes 4K,16K,42K,64K,256K,1M --no-verify-pass --out $OUT/bench-host-staged
run 30 $B tune --gpus 0,1 --out $OUT/tuning-w2.toml
grep -v "^\[[0-9]/" $L | grep -vE "^\[rank [0-9]\] \[[0-9]+/" | cut -c1-170 | tail -90
