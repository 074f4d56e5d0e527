#!/usr/bin/env bash
# One H200. The 1 MB figure of run2 (late 4.09-4.10 vs base 3.99-4.03 us, processes under MPS) again,
# base and late alternating three times at 256K,1M,2M; then the final fused kernel's trace
# (in-process, 2 and 4 ranks, 3 x 7168).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TP_ALLREDUCE_TIMEOUT_MS=5000
mkdir -p $OUT; S=.dev/ship; L=/tmp/logs; mkdir -p $L
for v in base late; do xz -d -c $S/$v.xz > /tmp/v-$v; chmod +x /tmp/v-$v; done
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d > $L/mps.log 2>&1; echo "mps start rc=$?" >> $L/mps.log
P="--processes --gpus 0 --ranks-per-gpu 2 --sizes 256K,1M,2M --dtype bf16 --repeats 20 --algorithms auto --no-verify-pass"
for round in 1 2 3; do for v in base late; do timeout 60 /tmp/v-$v bench $P --out /tmp/o > $L/c-$v-$round.log 2>&1; echo "rc=$?" >> $L/c-$v-$round.log; done; done
echo quit | nvidia-cuda-mps-control >> $L/mps.log 2>&1; echo "mps stop rc=$?" >> $L/mps.log
for r in 2 4; do timeout 100 /tmp/v-late bench --gpus 0 --ranks-per-gpu $r --sizes 42K --dtype bf16 --repeats 20 --algorithms auto --fused --fused-shape 3x7168 --trace --no-verify-pass --out /tmp/o > $L/t-late-${r}r.log 2>&1; echo "rc=$?" >> $L/t-late-${r}r.log; done
cd $L
for f in c-*.log; do echo "$f $(grep -E '\] +[0-9]+ [KM]B +\| auto' $f | awk -F'|' '{printf "%s ", $4}' | tr -s ' ') $(grep -h rc= $f)"; done
for f in t-*.log; do echo "== $f"; grep -E "fused:|^  (fused|allreduce|ours\+separate) |rc=" $f; done
tar czf $OUT/logs.tgz *; true
