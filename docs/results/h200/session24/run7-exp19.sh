#!/usr/bin/env bash
# A/B of the block count consumed after the polls (plain and fused one-shot push), ranks sharing one H200:
# base = dece071 kernels; e = fused change only; new = this tree. Then the one-GPU test suite of this tree.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TP_ALLREDUCE_TIMEOUT_MS=5000
mkdir -p $OUT
xz -d -c .dev/base.xz > .dev/v-base; xz -d -c .dev/tp-allreduce.xz > .dev/v-new
xz -d -k -f .dev/suite.xz; cp .dev/v-new .dev/tp-allreduce; chmod +x .dev/v-* .dev/suite .dev/tp-allreduce
for round in 1 2; do for v in base new; do
  for r in 2 4; do
    log=$OUT/ar-$v-${r}r-$round.log
    timeout 100 .dev/v-$v bench --gpus 0 --ranks-per-gpu $r --sizes 4K,42K,256K,1M --dtype bf16 --repeats 20 --algorithms auto --fused --fused-shape 3x7168 --out /tmp/o > $log 2>&1; echo "rc=$?" >> $log
  done
done; done
cd $OUT; for f in ar-*.log; do echo "== $f"; grep -hE "^ +[0-9]+ [KM]B \| auto|^ +(fused|allreduce|ours\+separate) |ms per pass|rc=[^0]" $f; done; cd - > /dev/null
E="env TP_ALLREDUCE_REQUIRE_GPU=1 TP_ALLREDUCE_REQUIRE_GPUS=1 TP_ALLREDUCE_BIN=$PWD/.dev/tp-allreduce"
timeout 330 $E .dev/suite --test-threads=1 --skip cpu:: --skip ptx:: --skip cli:: --skip sentinel_model:: > $OUT/suite-1gpu.log 2>&1; echo "rc=$?" >> $OUT/suite-1gpu.log
grep -hE "^test .*(FAILED|ignored)|test result|rc=" $OUT/suite-1gpu.log; grep -c "\.\.\. ok" $OUT/suite-1gpu.log
cd $OUT; tar czf ar-logs.tgz ar-*.log && rm ar-*.log
