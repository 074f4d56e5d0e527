#!/usr/bin/env bash
# Device runs (one H200): the island push family as processes under MPS
# (one process per rank, islands 2+2 on 4 ranks and 4+4 on 8), and the
# Python lifecycle tests (all-gather / reduce-scatter included) from the
# pip-installed wheel (bash python/build-wheel.sh .carry/ours here). The
# lifecycle tests ran in a first run (python-lifecycle.log) whose benches
# failed with 32 device connections per process under MPS; the benches
# (mps22.log, mps44.log) ran again with 2, as here.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
L=$OUT; S=$L/summary.txt; mkdir -p /tmp/b
run() { local name=$1 lim=$2; shift 2; local t=$SECONDS; timeout $lim "$@" > $L/$name.log 2>&1; local rc=$?; echo "$name rc=$rc $((SECONDS-t))s" | tee -a $S; }
nvidia-smi -L | tee -a $S
/opt/torch/.venv/bin/python3 -c "
import lzma, os
for f in ('tpa',):
    open('/tmp/b/' + f, 'wb').write(lzma.open('.carry/bin/' + f + '.xz').read()); os.chmod('/tmp/b/' + f, 0o755)
"
export TP_ALLREDUCE_BIN=/tmp/b/tpa TP_ALLREDUCE_TUNING_FILE=/tmp/none.toml
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d
export CUDA_DEVICE_MAX_CONNECTIONS=2
B="/tmp/b/tpa bench --processes --gpus 0 --repeats 10 --no-verify-pass"
A=hierarchical,pipelined-hierarchical,two-shot-push
run mps22 120 $B --ranks-per-gpu 4 --island-size 2 --sizes 4K,42K,256K,1M,8M --algorithms $A --out $L/mps22
run mps44 120 $B --ranks-per-gpu 8 --island-size 4 --sizes 42K,1M --algorithms $A --out $L/mps44
echo quit | nvidia-cuda-mps-control
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
run py-lifecycle 200 env PYTHON=/opt/torch/.venv/bin/python OUT=$L/py SKIP_DECODE=1 PYTEST_ARGS="python/tests/test_gpu_lifecycle.py -rs -v" bash python/run-gpu-checks.sh .carry/ours
grep -E "PASSED|FAILED|SKIPPED|passed|failed|error" $L/py-lifecycle.log | tail -n 14 | tee -a $S
for f in mps22 mps44; do echo "== $f"; grep -vE '^\s*$' $L/$f.log | tail -n 24; done
