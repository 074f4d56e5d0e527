#!/bin/bash
# tp-allreduce-mid = commit c073532 (fresh IPC export, no deregistration); tp-allreduce = the tree that became bb5cda5, minus its ALREADY_MAPPED message.
# Which change fixed the stale reads: c073532 (fresh IPC export, no deregistration) vs the working tree.
L=$OUT/log.txt
export TP_ALLREDUCE_TIMEOUT_MS=5000 CUDA_DEVICE_MAX_CONNECTIONS=2 XDG_RUNTIME_DIR=/tmp
run() { t=$1; shift; echo "=== [$(date +%T)] $*" >> $L; timeout $t "$@" >> $L 2>&1; echo "exit $? [$(date +%T)]" >> $L; }
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d && echo "MPS daemon started" >> $L
A="--algorithms auto,one-shot-pull,two-shot-pull --iterations 20 --repeats 5 --warmup 1"
run 120 .dev2/tp-allreduce-mid bench --processes --ranks-per-gpu 2 $A --no-verify-pass --out $OUT/bench-mid
run 120 .dev2/tp-allreduce-mid bench --processes --ranks-per-gpu 2 $A --no-verify-pass --out $OUT/bench-mid2
run 150 .dev2/tp-allreduce bench --processes --ranks-per-gpu 4 $A --out $OUT/bench-new-w4
echo quit | nvidia-cuda-mps-control
grep -E "^===|^exit|error|failed|verify" $L | cut -c1-250
