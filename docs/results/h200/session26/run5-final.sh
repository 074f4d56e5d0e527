#!/usr/bin/env bash
# One H200. final = this tree after the review (the cluster entries trap on a one-block cluster, their
# push's row stride at least 1; the plain kernels' SASS is the measured `late`'s). The fused tests and
# the timeout tests of final, then final against late and base, in-process, alternating, two rounds.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TP_ALLREDUCE_TIMEOUT_MS=5000
mkdir -p $OUT; S=.dev/ship; L=/tmp/logs; mkdir -p $L
for v in base late final suite; do xz -d -c $S/$v.xz > /tmp/v-$v; chmod +x /tmp/v-$v; done
E="env TP_ALLREDUCE_REQUIRE_GPU=1 TP_ALLREDUCE_REQUIRE_GPUS=1 TP_ALLREDUCE_BIN=/tmp/v-final"
timeout 300 $E /tmp/v-suite --test-threads=1 gpu_fused gpu_timeout > $OUT/fused-tests-1gpu.log 2>&1; echo "rc=$?" >> $OUT/fused-tests-1gpu.log
grep -hE "^test |test result|rc=" $OUT/fused-tests-1gpu.log
for round in 1 2; do for v in base late final; do
  timeout 100 /tmp/v-$v bench --gpus 0 --ranks-per-gpu 2 --sizes 42K --dtype bf16 --repeats 20 --algorithms auto --fused --fused-shape 3x7168 --out /tmp/o > $L/f-$v-2r-$round.log 2>&1; echo "rc=$?" >> $L/f-$v-2r-$round.log
  timeout 100 /tmp/v-$v bench --gpus 0 --ranks-per-gpu 4 --sizes 42K --dtype bf16 --repeats 20 --algorithms auto --fused --fused-shape 3x7168 --no-verify-pass --out /tmp/o > $L/f-$v-4r-$round.log 2>&1; echo "rc=$?" >> $L/f-$v-4r-$round.log
done; done
cd $L
for f in f-*.log; do printf "%-16s" $f; grep -hE "^ +[0-9]+ [KM]B +\| auto" $f | awk -F'|' '{printf " %s", $4}' | tr -s ' '; grep -E "^  (fused|allreduce|ours\+separate) " $f | awk '{printf " %s=%s", $1, $2}'; grep -A1 "verify pass" $f | grep "ms per pass" | awk '{printf " vp=%s", $1}'; grep -h "rc=" $f | tr '\n' ' '; echo; done
tar czf $OUT/logs.tgz *; true
