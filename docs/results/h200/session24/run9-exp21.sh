#!/usr/bin/env bash
# base = dece071, c4d = c4d37b5, s200/s500 = c4d37b5 + a second poll load issued 200/500 clocks after the
# first (cluster entries), final = this tree (cluster wait inside cluster_sum, size check at entry).
# Then this tree's one-GPU fused + timeout tests. Ranks share GPU 0.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TP_ALLREDUCE_TIMEOUT_MS=5000
mkdir -p $OUT
xz -d -k -f .dev/suite.xz; xz -d -k -f .dev/tp-allreduce.xz
for v in base c4d; do xz -d -c .dev/$v.xz > .dev/v-$v; done
for v in s200 s500; do xz -d -c .dev/diag-$v.xz > .dev/v-$v; done
cp .dev/tp-allreduce .dev/v-final; chmod +x .dev/v-* .dev/suite .dev/tp-allreduce
for round in 1 2; do for v in base c4d s200 s500 final; do
  log=$OUT/x-$v-2r-$round.log
  timeout 100 .dev/v-$v bench --gpus 0 --ranks-per-gpu 2 --sizes 42K --dtype bf16 --repeats 20 --algorithms auto --fused --fused-shape 3x7168 --trace --out /tmp/o > $log 2>&1; echo "rc=$?" >> $log
  log=$OUT/x-$v-4r-$round.log
  timeout 100 .dev/v-$v bench --gpus 0 --ranks-per-gpu 4 --sizes 42K --dtype bf16 --repeats 20 --algorithms auto --fused --fused-shape 3x7168 --trace --no-verify-pass --out /tmp/o > $log 2>&1; echo "rc=$?" >> $log
done; done
cd $OUT
for f in x-*.log; do printf "%-18s" $f; grep -E "fused:fused  .*\| 0 " $f | awk -F'|' '{printf " st %s wait %s tail %s", $8, $9, $10}'; grep -E "^  fused  " $f | awk '{printf " fused %s", $2}'; grep -E "^  allreduce  " $f | awk '{printf " ar %s", $2}'; grep -A1 "verify pass.*fused (" $f | tail -1 | awk '{printf " fverify %s", $1}'; echo; done
tar czf x-logs.tgz x-*.log && rm x-*.log
cd - > /dev/null
E="env TP_ALLREDUCE_REQUIRE_GPU=1 TP_ALLREDUCE_REQUIRE_GPUS=1 TP_ALLREDUCE_BIN=$PWD/.dev/tp-allreduce"
timeout 300 $E .dev/suite --test-threads=1 gpu_fused gpu_timeout > $OUT/fused-tests-1gpu.log 2>&1; echo "rc=$?" >> $OUT/fused-tests-1gpu.log
grep -hE "^test |test result|rc=" $OUT/fused-tests-1gpu.log
