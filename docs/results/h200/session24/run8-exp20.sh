#!/usr/bin/env bash
# Final one-GPU validation of this tree: fused GPU tests, then fused benches against dece071 (base), ranks sharing GPU 0.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TP_ALLREDUCE_TIMEOUT_MS=5000
mkdir -p $OUT
xz -d -k -f .dev/suite.xz; xz -d -k -f .dev/tp-allreduce.xz; xz -d -c .dev/base.xz > .dev/v-base
cp .dev/tp-allreduce .dev/v-new; chmod +x .dev/v-* .dev/suite .dev/tp-allreduce
E="env TP_ALLREDUCE_REQUIRE_GPU=1 TP_ALLREDUCE_REQUIRE_GPUS=1 TP_ALLREDUCE_BIN=$PWD/.dev/tp-allreduce"
timeout 300 $E .dev/suite --test-threads=1 gpu_fused gpu_timeout > $OUT/fused-tests-1gpu.log 2>&1; echo "rc=$?" >> $OUT/fused-tests-1gpu.log
grep -hE "^test |test result|rc=" $OUT/fused-tests-1gpu.log
for round in 1 2; do for v in base new; do
  for case in "2 3x7168" "4 3x7168" "2 3x16384" "2 1x7168"; do
    set -- $case; log=$OUT/final-$v-$1r-$2-$round.log
    timeout 100 .dev/v-$v bench --gpus 0 --ranks-per-gpu $1 --sizes 42K --dtype bf16 --repeats 20 --algorithms auto --fused --fused-shape $2 --trace --out /tmp/o > $log 2>&1; echo "rc=$?" >> $log
  done
done; done
cd $OUT
for f in final-*.log; do printf "%-28s" $f; grep -E "^  fused  " $f | awk '{printf " fused %s", $2}'; grep -E "^  allreduce  " $f | awk '{printf " ar %s", $2}'; grep -E "^  ours\+separate  " $f | awk '{printf " sep %s", $2}'; grep -A1 "verify pass.*fused (" $f | tail -1 | awk '{printf " fverify %s", $1}'; grep -A1 "verify pass.*auto (" $f | tail -1 | awk '{printf " verify %s", $1}'; grep -c "rc=0" $f; done
tar czf final-logs.tgz final-*.log && rm final-*.log
