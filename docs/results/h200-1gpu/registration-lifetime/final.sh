#!/bin/bash
# Binaries: tp-allreduce and suite built from commit 61d0dc4 (release, stripped).
L=$OUT/log.txt
export TP_ALLREDUCE_TIMEOUT_MS=5000 XDG_RUNTIME_DIR=/tmp
run() { t=$1; shift; echo "=== [$(date +%T)] $*" >> $L; timeout $t "$@" >> $L 2>&1; echo "exit $? [$(date +%T)]" >> $L; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d && echo "MPS daemon started" >> $L
A="--algorithms auto,one-shot-pull,two-shot-pull --iterations 20 --repeats 5 --warmup 1"
CUDA_DEVICE_MAX_CONNECTIONS=2 run 120 .dev2/tp-allreduce bench --processes --ranks-per-gpu 2 $A --out $OUT/bench-w2
echo quit | nvidia-cuda-mps-control
export TP_ALLREDUCE_REQUIRE_GPU=1 CUDA_DEVICE_MAX_CONNECTIONS=32 TP_ALLREDUCE_BIN=$PWD/.dev2/tp-allreduce
timeout 170 .dev2/suite --test-threads=1 --skip ptx:: --skip multiprocess > $OUT/inproc.log 2>&1; echo "in-process exit: $?" >> $OUT/inproc.log
export TP_ALLREDUCE_REQUIRE_MPS=1
nvidia-cuda-mps-control -d && echo "MPS daemon started" >> $L
timeout 150 .dev2/suite --test-threads=1 --nocapture multiprocess > $OUT/mp.log 2>&1; echo "multiprocess exit: $?" >> $OUT/mp.log
echo quit | nvidia-cuda-mps-control
grep -E "^===|^exit|error|failed|verify pass" $L | cut -c1-250
grep -E "test result|exit:|FAILED|panicked" $OUT/inproc.log
grep -E "^test |test result|selftest passed|exit:|panicked" $OUT/mp.log | cut -c1-220
