#!/usr/bin/env bash
# Final code under MPS on one H200: the tests whose processes share a GPU, then the fused bench with one process per rank.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TP_ALLREDUCE_TIMEOUT_MS=5000
mkdir -p $OUT
xz -d -k -f .dev/suite.xz; xz -d -k -f .dev/tp-allreduce.xz; chmod +x .dev/suite .dev/tp-allreduce
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d > $OUT/mps.log 2>&1; echo "mps start rc=$?" >> $OUT/mps.log
E="env TP_ALLREDUCE_REQUIRE_GPU=1 TP_ALLREDUCE_REQUIRE_GPUS=1 TP_ALLREDUCE_REQUIRE_MPS=1 CUDA_DEVICE_MAX_CONNECTIONS=2 TP_ALLREDUCE_BIN=$PWD/.dev/tp-allreduce"
timeout 200 $E .dev/suite --test-threads=1 multiprocess gpu_vmm_processes gpu_mixed_placement > $OUT/mps-tests-1gpu.log 2>&1; echo "rc=$?" >> $OUT/mps-tests-1gpu.log
grep -hE "^test |test result|rc=" $OUT/mps-tests-1gpu.log
timeout 80 .dev/tp-allreduce bench --processes --gpus 0 --ranks-per-gpu 2 --sizes 42K --dtype bf16 --repeats 20 --algorithms auto --fused --fused-shape 3x7168 --trace --out /tmp/o > $OUT/mps-fused-bench.log 2>&1; echo "rc=$?" >> $OUT/mps-fused-bench.log
grep -hE "fused:|^ +(fused|allreduce|ours\+separate) |ms per pass|rc=|error" $OUT/mps-fused-bench.log
echo quit | nvidia-cuda-mps-control >> $OUT/mps.log 2>&1; echo "mps stop rc=$?" >> $OUT/mps.log; cat $OUT/mps.log
