#!/usr/bin/env bash
# Device run (one H200, ranks sharing GPU 0 in one process): the pipelined
# hierarchical kernel's benches against hierarchical and two-shot push
# (islands 2+2 on 4 ranks, 4+4 on 8), then the GPU suite's checks of the
# island push family (correctness matrix, any launch shape against
# hierarchical's bits, chunked, host-staged, per-pair, alternation,
# counter wrap, timeouts, sentinel-like payloads, 1000-replay graphs).
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
A=hierarchical,pipelined-hierarchical,two-shot-push
run islands22 90 $B --ranks-per-gpu 4 --island-size 2 --sizes 4K,42K,256K,1M,4M,8M --algorithms $A --out $L/islands22
run islands44 90 $B --ranks-per-gpu 8 --island-size 4 --sizes 42K,1M,8M --algorithms $A --out $L/islands44
T="env TP_ALLREDUCE_REQUIRE_GPU=1 /tmp/b/suite --test-threads=1"
run suite 400 $T gpu_pipelined:: gpu_allreduce::hierarchical_matrix gpu_allreduce::chunked_launches_all_algorithms gpu_allreduce::host_staged_transport_push_algorithms gpu_allreduce::back_to_back_alternating_algorithms gpu_wrap:: gpu_timeout::missing_rank_times_out_with_its_name gpu_payload_edges:: gpu_pcie_family::island_push_graphs_replay_1000_times gpu_pcie_family::per_pair_transport
grep -hE "^test |^test result|panicked|cases|checked" $L/suite.log | tee -a $S
for f in islands22 islands44; do echo "== $f"; grep -vE '^\s*$' $L/$f.log | tail -n 26; done
