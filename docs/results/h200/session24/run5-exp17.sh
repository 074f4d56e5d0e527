#!/usr/bin/env bash
# Where the cluster inbox is opened: base = entry, thread 0 (dece071); a = after the push, thread 0 (tree);
# b = after advance_generation, thread 0; c = entry, last thread; d = after advance_generation, last thread.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TP_ALLREDUCE_TIMEOUT_MS=5000
mkdir -p $OUT
xz -d -c .dev/base.xz > .dev/v-base; xz -d -c .dev/tp-allreduce.xz > .dev/v-a
for v in b c d; do xz -d -c .dev/diag-$v.xz > .dev/v-$v; done; chmod +x .dev/v-*
A="--gpus 0 --sizes 42K --dtype bf16 --repeats 20 --fused --algorithms auto --trace --no-verify-pass"
for round in 1 2; do for v in base a b c d; do for case in "2 3x7168" "4 3x7168"; do
  set -- $case; log=$OUT/pos-$v-$1r-$round.log
  timeout 100 .dev/v-$v bench $A --ranks-per-gpu $1 --fused-shape $2 --out /tmp/o > $log 2>&1; echo "rc=$?" >> $log
done; done; done
cd $OUT
for f in pos-*.log; do echo "== $f"; grep -hE "fused:fused  .*\| 0 |^ +(fused|allreduce) |rc=[^0]" $f; done
tar czf pos-logs.tgz pos-*.log && rm pos-*.log
