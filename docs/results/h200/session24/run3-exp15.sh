#!/usr/bin/env bash
# A/B: .dev/base (previous kernels) against .dev/tp-allreduce (this tree), ranks sharing one H200.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TP_ALLREDUCE_TIMEOUT_MS=5000
mkdir -p $OUT
xz -d -k -f .dev/tp-allreduce.xz; xz -d -c .dev/base.xz > .dev/base; chmod +x .dev/base .dev/tp-allreduce
A="--gpus 0 --sizes 42K --dtype bf16 --repeats 20 --fused --algorithms auto --trace"
for round in 1 2; do
for bin in base tp-allreduce; do
  for case in "2 3x7168" "4 3x7168" "2 3x16384"; do
    set -- $case
    log=$OUT/ab-$bin-$1r-$2-$round.log
    timeout 100 .dev/$bin bench $A --ranks-per-gpu $1 --fused-shape $2 --out /tmp/o > $log 2>&1; echo "rc=$?" >> $log
  done
done
done
cd $OUT
for f in ab-*.log; do echo "== $f"; grep -hE "fused:fused|^ +(fused|allreduce|ours\+separate) |per pass|verify|rc=" $f; done
tar czf ab-logs.tgz ab-*.log && rm ab-*.log
