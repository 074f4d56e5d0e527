#!/usr/bin/env bash
# Diagnostic stamps: d1 = after advance_generation, d2 = after the first pack's poll+sum, cur = after residual add/store.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TP_ALLREDUCE_TIMEOUT_MS=5000
mkdir -p $OUT
for b in diag-d1 diag-d2 tp-allreduce; do xz -d -c .dev/$b.xz > .dev/$b; chmod +x .dev/$b; done
A="--gpus 0 --sizes 42K --dtype bf16 --repeats 20 --fused --algorithms auto --trace --no-verify-pass"
for bin in diag-d1 diag-d2 tp-allreduce; do
  for case in "2 3x7168" "4 3x7168"; do
    set -- $case
    log=$OUT/diag-$bin-$1r-$2.log
    timeout 100 .dev/$bin bench $A --ranks-per-gpu $1 --fused-shape $2 --out /tmp/o > $log 2>&1; echo "rc=$?" >> $log
  done
done
cd $OUT
for f in diag-*.log; do echo "== $f"; grep -hE "fused:fused|^ +(fused|allreduce) |rc=" $f; done
tar czf diag-logs.tgz diag-*.log && rm diag-*.log
