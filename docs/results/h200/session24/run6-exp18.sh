#!/usr/bin/env bash
# d = inbox opened after advance_generation by the last thread (candidate); e = d + the generation
# count's answer consumed after the rows; f = d + the residual/weight loads after the generation barrier.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TP_ALLREDUCE_TIMEOUT_MS=5000
mkdir -p $OUT
for v in d e f; do xz -d -c .dev/diag-$v.xz > .dev/v-$v; done; chmod +x .dev/v-*
A="--gpus 0 --sizes 42K --dtype bf16 --repeats 20 --fused --algorithms auto --trace --no-verify-pass"
for round in 1 2; do for v in d e f; do for case in "2 3x7168" "4 3x7168" "2 3x16384"; do
  set -- $case; log=$OUT/g-$v-$1r-$2-$round.log
  timeout 100 .dev/v-$v bench $A --ranks-per-gpu $1 --fused-shape $2 --out /tmp/o > $log 2>&1; echo "rc=$?" >> $log
done; done; done
cd $OUT
for f in g-*.log; do echo "== $f"; grep -hE "fused:fused  .*\| 0 |^ +(fused|allreduce) |rc=[^0]" $f; done
tar czf g-logs.tgz g-*.log && rm g-*.log
