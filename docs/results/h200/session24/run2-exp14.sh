#!/usr/bin/env bash
# Trace of the fused kernel (clusters / block per row) vs the plain allreduce, ranks sharing one H200.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TP_ALLREDUCE_TIMEOUT_MS=5000
mkdir -p $OUT
for f in .dev/tp-allreduce; do [ -x $f ] || xz -d -k -f $f.xz; done
B=".dev/tp-allreduce bench --gpus 0 --sizes 42K --dtype bf16 --repeats 20 --fused --algorithms auto --no-verify-pass --trace"
timeout 100 $B --ranks-per-gpu 2 --fused-shape 3x7168 --out /tmp/b1 > $OUT/trace-2r-cluster.log 2>&1; echo "rc=$?" >> $OUT/trace-2r-cluster.log
TP_ALLREDUCE_FUSED_CLUSTERS=0 timeout 100 $B --ranks-per-gpu 2 --fused-shape 3x7168 --out /tmp/b2 > $OUT/trace-2r-rows.log 2>&1; echo "rc=$?" >> $OUT/trace-2r-rows.log
timeout 100 $B --ranks-per-gpu 2 --fused-shape 1x7168 --out /tmp/b3 > $OUT/trace-2r-1row.log 2>&1; echo "rc=$?" >> $OUT/trace-2r-1row.log
timeout 100 $B --ranks-per-gpu 4 --fused-shape 3x7168 --out /tmp/b4 > $OUT/trace-4r-cluster.log 2>&1; echo "rc=$?" >> $OUT/trace-4r-cluster.log
cd $OUT && grep -hE "fused|gap|rank  *\| shape|^ *42 KB|^ +(fused|ours|allreduce) " trace-*.log
