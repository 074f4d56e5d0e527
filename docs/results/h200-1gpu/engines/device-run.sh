#!/usr/bin/env bash
# Device run 5 (one command, what the budget allows): the engine harness
# (SGLang 0.5.23, vLLM 0.33.0 driving tp-allreduce), the GPU suite's checks
# of the new all-gather/reduce-scatter kernels and the island push, the
# islands 2+2 and all-gather/reduce-scatter benches, the Python lifecycle
# and all-gather/reduce-scatter tests.
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
T="env TP_ALLREDUCE_REQUIRE_GPU=1 /tmp/b/suite --test-threads=1"
run suite 60 $T gpu_collectives:: gpu_allreduce::hierarchical_matrix gpu_payload_edges::sentinel_like_payloads_in_every_payload_completion_kernel
grep -hE "^test |^test result|panicked" $L/suite.log | tee -a $S
run engines 300 env OUT=$L/eng bash python/engine_checks/run-on-gpu.sh .carry/ours
grep -E "^(PASS|FAIL|NOT RUN|sglang|vllm|engine checks|run-on-gpu)" $L/engines.log | tail -n 40 | tee -a $S
B="/tmp/b/tpa bench --gpus 0 --repeats 10 --no-verify-pass"
run islands 20 $B --ranks-per-gpu 4 --island-size 2 --sizes 4K,42K,256K --algorithms hierarchical,two-shot-push --out $L/islands
run all-gather 12 $B --ranks-per-gpu 4 --collective all-gather --sizes 4K,42K,1M --out $L/all-gather
run reduce-scatter 12 $B --ranks-per-gpu 4 --collective reduce-scatter --sizes 4K,42K,1M --out $L/reduce-scatter
run py-lifecycle 40 env PYTHON=/opt/torch/.venv/bin/python OUT=$L/py SKIP_DECODE=1 PYTEST_ARGS="python/tests/test_gpu_lifecycle.py -rs" bash python/run-gpu-checks.sh .carry/ours
grep -E "passed|failed|error" $L/py-lifecycle.log | tail -n 6 | tee -a $S
for f in islands all-gather reduce-scatter; do echo "== $f"; grep -vE '^\s*$' $L/$f.log | tail -n 22; done
