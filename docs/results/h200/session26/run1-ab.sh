#!/usr/bin/env bash
# One H200. base = 6d5974c (last stop's tip), new = this tree (cluster shape passed in the
# parameters, the block count's atomic unaggregated and its answer taken at the end on sm_90+).
# A: in-process ranks on their own streams, base and new alternating, two rounds.
# B: under MPS, one process per rank on GPU 0: FlashInfer's PCIe-IPC kernels (peer bench patched by
#    .ci/peer-shared-gpu.py to let ranks share a GPU; FlashInfer backends only: NCCL refuses two ranks
#    on one GPU), then base and new `bench --processes`, in the same command.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TP_ALLREDUCE_TIMEOUT_MS=5000
mkdir -p $OUT; S=.dev/ship
xz -d -c $S/base.xz > /tmp/v-base; xz -d -c $S/tp-allreduce.xz > /tmp/v-new; chmod +x /tmp/v-*
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt 2>&1
L=/tmp/logs; mkdir -p $L
for round in 1 2; do for v in base new; do
  timeout 100 /tmp/v-$v bench --gpus 0 --ranks-per-gpu 2 --sizes 4K,42K,256K,1M --dtype bf16 --repeats 20 --algorithms auto --fused --fused-shape 3x7168 --trace --out /tmp/o > $L/a-$v-2r-$round.log 2>&1; echo "rc=$?" >> $L/a-$v-2r-$round.log
  timeout 100 /tmp/v-$v bench --gpus 0 --ranks-per-gpu 4 --sizes 42K --dtype bf16 --repeats 20 --algorithms auto --fused --fused-shape 3x7168 --no-verify-pass --out /tmp/o > $L/a-$v-4r-$round.log 2>&1; echo "rc=$?" >> $L/a-$v-4r-$round.log
done; done
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d > $L/mps.log 2>&1; echo "mps start rc=$?" >> $L/mps.log
P="--processes --gpus 0 --ranks-per-gpu 2 --sizes 4K,16K,42K,64K,256K,1M,8M --dtype bf16 --repeats 20 --algorithms auto --trace"
timeout 90 /tmp/v-base bench $P --out /tmp/o > $L/b-base-1.log 2>&1; echo "rc=$?" >> $L/b-base-1.log
timeout 90 /tmp/v-new bench $P --out /tmp/o > $L/b-new-1.log 2>&1; echo "rc=$?" >> $L/b-new-1.log
(TP_PEER_SHARED_GPUS=1 OUT=$L PYTHONUNBUFFERED=1 timeout 230 python3 .peers/flashinfer-pcie/run_peer_bench.py --backends fi_seed,fi_best --total-timeout 220 --fi-timeout 210 > $L/peer.log 2>&1; echo "rc=$?" >> $L/peer.log)
timeout 90 /tmp/v-new bench $P --out /tmp/o > $L/b-new-2.log 2>&1; echo "rc=$?" >> $L/b-new-2.log
timeout 90 /tmp/v-base bench $P --out /tmp/o > $L/b-base-2.log 2>&1; echo "rc=$?" >> $L/b-base-2.log
echo quit | nvidia-cuda-mps-control >> $L/mps.log 2>&1; echo "mps stop rc=$?" >> $L/mps.log
cd $L
for f in a-*.log; do printf "%-16s" $f; grep -hE "^ +[0-9]+ [KM]B \| auto" $f | awk -F'|' '{printf " %s", $4}'; grep -E "^  (fused|allreduce|ours\+separate) " $f | awk '{printf " %s=%s", $1, $2}'; grep -A1 "verify pass" $f | grep "ms per pass" | awk '{printf " vp=%s", $1}'; grep -h "rc=" $f | tr '\n' ' '; echo; done
for f in b-*.log; do printf "%-16s" $f; grep -hE "^ +[0-9]+ [KM]B \| auto" $f | awk -F'|' '{printf " %s", $4}'; grep -A1 "verify pass" $f | grep "ms per pass" | awk '{printf " vp=%s", $1}'; grep -h "rc=" $f | tr '\n' ' '; echo; done
tail -30 peer.log
tar czf $OUT/logs.tgz *; cp peer.log $OUT/ 2>/dev/null; cp peer_bench.json $OUT/ 2>/dev/null; true
