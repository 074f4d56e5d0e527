#!/usr/bin/env bash
# One H200: this tree's integration suite, first the one-GPU part (ranks in-process, sharing GPU 0),
# then under MPS the tests whose processes share the GPU.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TP_ALLREDUCE_TIMEOUT_MS=5000
mkdir -p $OUT; S=.dev/ship
xz -d -c $S/suite.xz > /tmp/suite; xz -d -c $S/late.xz > /tmp/tp-allreduce; chmod +x /tmp/suite /tmp/tp-allreduce
E="env TP_ALLREDUCE_REQUIRE_GPU=1 TP_ALLREDUCE_REQUIRE_GPUS=1 TP_ALLREDUCE_BIN=/tmp/tp-allreduce"
timeout 380 $E /tmp/suite --test-threads=1 --skip cpu:: --skip ptx:: --skip cli:: --skip sentinel_model:: --skip multiprocess --skip gpu_vmm_processes --skip gpu_mixed_placement > $OUT/suite-1gpu.log 2>&1; echo "rc=$?" >> $OUT/suite-1gpu.log
grep -hE "^test .*(FAILED|ignored)|test result|rc=" $OUT/suite-1gpu.log; echo "ok lines: $(grep -c '\.\.\. ok' $OUT/suite-1gpu.log)"; grep -c "skipped:" $OUT/suite-1gpu.log
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d > $OUT/mps.log 2>&1; echo "mps start rc=$?" >> $OUT/mps.log
timeout 180 $E TP_ALLREDUCE_REQUIRE_MPS=1 CUDA_DEVICE_MAX_CONNECTIONS=2 /tmp/suite --test-threads=1 multiprocess gpu_vmm_processes gpu_mixed_placement > $OUT/mps-tests-1gpu.log 2>&1; echo "rc=$?" >> $OUT/mps-tests-1gpu.log
echo quit | nvidia-cuda-mps-control >> $OUT/mps.log 2>&1; echo "mps stop rc=$?" >> $OUT/mps.log
grep -hE "^test .*(FAILED|ignored)|test result|rc=" $OUT/mps-tests-1gpu.log; cat $OUT/mps.log
