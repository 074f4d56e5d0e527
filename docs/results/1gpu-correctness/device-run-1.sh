#!/usr/bin/env bash
# Device run 1 (one GPU, ranks sharing GPU 0): the tests of issue 35 on
# the build before the change (2b4aace with the new test files: "old") and
# after ("new"), and the measured-auto tests (issue 36) on "new".
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
L=$OUT; S=$OUT/summary.txt; mkdir -p /tmp/b
run() { local name=$1 lim=$2; shift 2; local t=$SECONDS; timeout $lim "$@" > $L/$name.log 2>&1; local rc=$?; echo "$name rc=$rc $((SECONDS-t))s" | tee -a $S; }
nvidia-smi -L | tee -a $S
/opt/torch/.venv/bin/python3 -c "
import lzma, os
for f in os.listdir('.carry/bin'):
    n = f[:-3]; open('/tmp/b/' + n, 'wb').write(lzma.open('.carry/bin/' + f).read()); os.chmod('/tmp/b/' + n, 0o755)
"
export TP_ALLREDUCE_TUNING_FILE=/tmp/none.toml TP_ALLREDUCE_REQUIRE_GPU=1 TP_ALLREDUCE_CACHE_DIR=/tmp/tpa-cache
T="gpu_collectives::all_gather_copies_every_bit_pattern gpu_concurrent:: cli::bench_checks_each_call_against_the_algorithm_that_ran"
# Before: each test is expected to fail (a timeout is a failure too).
run old-tests 240 env TP_ALLREDUCE_BIN=/tmp/b/tpa-old /tmp/b/suite-old --test-threads=1 --nocapture $T
run new-tests 330 env TP_ALLREDUCE_BIN=/tmp/b/tpa /tmp/b/suite --test-threads=1 --nocapture $T gpu_measured_auto::
for f in old-tests new-tests; do grep -ahE "^test |test result|panicked|checked|: ok$|cold|warm" $L/$f.log | cut -c1-400 | head -n 60 | sed "s/^/$f: /" | tee -a $S; done
# An SM-limited context (MPS client at 20%): the old CLI's bench (caps
# from the whole GPU) and the new suite's test of the same bench.
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d
run old-limited-sm 60 env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20 CUDA_DEVICE_MAX_CONNECTIONS=8 TP_ALLREDUCE_LAUNCH_TIMEOUT_MS=15000 /tmp/b/tpa-old bench --gpus 0 --ranks-per-gpu 4 --island-size 2 --sizes 4M --repeats 3 --no-verify-pass --algorithms two-shot-push,hierarchical,pipelined-hierarchical,one-shot-push,one-shot-pull,two-shot-pull
run new-limited-sm 90 env TP_ALLREDUCE_BIN=/tmp/b/tpa TP_ALLREDUCE_REQUIRE_MPS=1 /tmp/b/suite --test-threads=1 --nocapture multiprocess::a_limited_sm_context_sizes_its_grids_to_its_sms
echo quit | nvidia-cuda-mps-control
for f in old-limited-sm new-limited-sm; do grep -aE "error|timeout|test result|ok$|MiB" $L/$f.log | cut -c1-300 | head -n 12 | sed "s/^/$f: /" | tee -a $S; done
