#!/bin/bash
# Binaries (built off the device, copied to .dev2/ and stripped): tp-allreduce-old = commit 69e12f2
# (IPC handles cached by allocation base), tp-allreduce and suite = the tree that became bb5cda5 (deregister_buffers), minus its ALREADY_MAPPED message.
# One device run: the stale-registration reproduction (old vs new binary), then the GPU suites.
L=$OUT/log.txt
export TP_ALLREDUCE_TIMEOUT_MS=5000
run() { t=$1; shift; echo "=== [$(date +%T)] $*" >> $L; timeout $t "$@" >> $L 2>&1; echo "exit $? [$(date +%T)]" >> $L; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d && echo "MPS daemon started" >> $L
export CUDA_DEVICE_MAX_CONNECTIONS=2
for b in old new; do
  B=.dev2/tp-allreduce; [ $b = old ] && B=.dev2/tp-allreduce-old
  XDG_RUNTIME_DIR=/tmp run 120 $B bench --processes --ranks-per-gpu 2 --algorithms auto,one-shot-pull,two-shot-pull --iterations 20 --repeats 5 --warmup 1 --no-verify-pass --out $OUT/bench-$b
done
echo quit | nvidia-cuda-mps-control
export TP_ALLREDUCE_REQUIRE_GPU=1 CUDA_DEVICE_MAX_CONNECTIONS=32 TP_ALLREDUCE_BIN=$PWD/.dev2/tp-allreduce
timeout 170 .dev2/suite --test-threads=1 --skip ptx:: --skip multiprocess > $OUT/inproc.log 2>&1; echo "in-process exit: $?" >> $OUT/inproc.log
export TP_ALLREDUCE_REQUIRE_MPS=1
nvidia-cuda-mps-control -d && echo "MPS daemon started" >> $L
timeout 150 .dev2/suite --test-threads=1 --nocapture multiprocess > $OUT/mp.log 2>&1; echo "multiprocess exit: $?" >> $OUT/mp.log
echo quit | nvidia-cuda-mps-control
grep -E "^===|^exit|error|failed" $L | cut -c1-220
grep -E "test result|exit:|FAILED|panicked" $OUT/inproc.log
grep -E "^test |test result|selftest passed|exit:|panicked" $OUT/mp.log | cut -c1-220
