#!/usr/bin/env bash
# Device run 2 (one GPU): the whole GPU suite of the new build, ranks
# sharing GPU 0 (multi-process tests under MPS), every skip a failure
# (TP_ALLREDUCE_REQUIRE_GPU=1): correctness matrix (worlds 2-8, every
# dtype, specials), 1000-replay graphs, the island family alternating with
# every other algorithm, timeouts, collectives, the new tests.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
S=$OUT/summary.txt; mkdir -p /tmp/b
nvidia-smi -L | tee -a $S
/opt/torch/.venv/bin/python3 -c "
import lzma, os
for n in ('suite', 'tpa'):
    open('/tmp/b/' + n, 'wb').write(lzma.open('.carry/bin/' + n + '.xz').read()); os.chmod('/tmp/b/' + n, 0o755)
"
export TP_ALLREDUCE_BIN=/tmp/b/tpa TP_ALLREDUCE_REQUIRE_GPU=1 TP_ALLREDUCE_REQUIRE_MPS=1 TP_ALLREDUCE_CACHE_DIR=/tmp/tpa-cache
t=$SECONDS
timeout 420 /tmp/b/suite --test-threads=1 --skip multiprocess > $OUT/suite.log 2>&1; echo "suite (in-process) rc=$? $((SECONDS-t))s" | tee -a $S
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d
t=$SECONDS
timeout 140 /tmp/b/suite --test-threads=1 multiprocess > $OUT/suite-mps.log 2>&1; echo "suite (processes, MPS) rc=$? $((SECONDS-t))s" | tee -a $S
echo quit | nvidia-cuda-mps-control
grep -aE "^test .*(FAILED|ignored)|test result|panicked" $OUT/suite.log $OUT/suite-mps.log | cut -c1-300 | head -n 40 | tee -a $S
