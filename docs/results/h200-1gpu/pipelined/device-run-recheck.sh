#!/usr/bin/env bash
# Device run (one H200, ranks in one process): the pipelined hierarchical
# after its phases B and C moved into macros shared with hierarchical
# (island_push.rs): its GPU tests, the island push graphs, and the 2+2
# bench at 4-256 KB and 1 MB against hierarchical and two-shot push.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
L=$OUT; S=$L/summary.txt; mkdir -p /tmp/b
run() { local name=$1 lim=$2; shift 2; local t=$SECONDS; timeout $lim "$@" > $L/$name.log 2>&1; local rc=$?; echo "$name rc=$rc $((SECONDS-t))s" | tee -a $S; }
nvidia-smi -L | tee -a $S
/opt/torch/.venv/bin/python3 -c "
import lzma, os
for f in ('suite', 'tpa'):
    open('/tmp/b/' + f, 'wb').write(lzma.open('.carry/bin/' + f + '.xz').read()); os.chmod('/tmp/b/' + f, 0o755)
"
export TP_ALLREDUCE_BIN=/tmp/b/tpa TP_ALLREDUCE_TUNING_FILE=/tmp/none.toml
B="/tmp/b/tpa bench --gpus 0 --repeats 10 --no-verify-pass"
run recheck22 60 $B --ranks-per-gpu 4 --island-size 2 --sizes 4K,42K,256K,1M --algorithms hierarchical,pipelined-hierarchical,two-shot-push --out $L/recheck22
T="env TP_ALLREDUCE_REQUIRE_GPU=1 /tmp/b/suite --test-threads=1 --nocapture"
run recheck-suite 300 $T gpu_pipelined:: gpu_allreduce::hierarchical_matrix gpu_pcie_family::island_push_graphs_replay_1000_times gpu_allreduce::back_to_back_alternating_algorithms gpu_payload_edges::sentinel_like_payloads_in_every_payload_completion_kernel
grep -hE "^test |^test result|panicked|cases|checked calls|per call" $L/recheck-suite.log | tee -a $S
grep -vE '^\s*$' $L/recheck22.log | head -n 16
