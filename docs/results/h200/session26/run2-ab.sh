#!/usr/bin/env bash
# One H200. base = 6d5974c; s25 = the tree left uncommitted by the previous session (cluster shape in
# the parameters, unaggregated block-count atomic, answer taken at the end on sm_90+); late = this tree
# (s25 + no atomic in one-block launches + `bench --trace` gap fix); early = late with the plain
# kernels taking the count's answer at once (FINISH_GENERATION_LATE = false; fused kernels as late).
# A: in-process ranks on GPU 0, variants alternating, two rounds. B: under MPS, one process per rank,
# FlashInfer's PCIe-IPC kernels (peer bench, ranks sharing GPU 0) between our runs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TP_ALLREDUCE_TIMEOUT_MS=5000
mkdir -p $OUT; S=.dev/ship; V="base s25 late early"
for v in $V; do xz -d -c $S/$v.xz > /tmp/v-$v; chmod +x /tmp/v-$v; done
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt 2>&1
L=/tmp/logs; mkdir -p $L
for round in 1 2; do for v in $V; do
  timeout 100 /tmp/v-$v bench --gpus 0 --ranks-per-gpu 2 --sizes 4K,42K,256K,1M --dtype bf16 --repeats 20 --algorithms auto --fused --fused-shape 3x7168 --out /tmp/o > $L/a-$v-2r-$round.log 2>&1; echo "rc=$?" >> $L/a-$v-2r-$round.log
done; for v in base late; do
  timeout 100 /tmp/v-$v bench --gpus 0 --ranks-per-gpu 4 --sizes 42K --dtype bf16 --repeats 20 --algorithms auto --fused --fused-shape 3x7168 --no-verify-pass --out /tmp/o > $L/a-$v-4r-$round.log 2>&1; echo "rc=$?" >> $L/a-$v-4r-$round.log
done; done
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d > $L/mps.log 2>&1; echo "mps start rc=$?" >> $L/mps.log
P="--processes --gpus 0 --ranks-per-gpu 2 --sizes 4K,16K,42K,64K,256K,1M,8M --dtype bf16 --repeats 20 --algorithms auto"
for v in base late early; do timeout 90 /tmp/v-$v bench $P --out /tmp/o > $L/b-$v-1.log 2>&1; echo "rc=$?" >> $L/b-$v-1.log; done
(TP_PEER_SHARED_GPUS=1 OUT=$L PYTHONUNBUFFERED=1 timeout 150 python3 .peers/flashinfer-pcie/run_peer_bench.py --backends fi_seed,fi_best --total-timeout 140 --fi-timeout 130 > $L/peer.log 2>&1; echo "rc=$?" >> $L/peer.log)
for v in early late base; do timeout 90 /tmp/v-$v bench $P --out /tmp/o > $L/b-$v-2.log 2>&1; echo "rc=$?" >> $L/b-$v-2.log; done
timeout 90 /tmp/v-late bench $P --trace --out /tmp/o > $L/b-late-trace.log 2>&1; echo "rc=$?" >> $L/b-late-trace.log
echo quit | nvidia-cuda-mps-control >> $L/mps.log 2>&1; echo "mps stop rc=$?" >> $L/mps.log
cd $L
for f in a-*.log b-*.log; do printf "%-18s" $f; grep -hE "^ +[0-9]+ [KM]B +\| auto" $f | awk -F'|' '{printf " %s", $4}' | tr -s ' '; grep -E "^  (fused|allreduce|ours\+separate) " $f | awk '{printf " %s=%s", $1, $2}'; grep -A1 "verify pass" $f | grep "ms per pass" | awk '{printf " vp=%s", $1}'; grep -h "rc=" $f | tr '\n' ' '; echo; done
sed -n "/^size/,/^8M/p" peer.log
tar czf $OUT/logs.tgz *; cp peer.log peer_bench.json $OUT/ 2>/dev/null; true
