#!/usr/bin/env bash
# Device run 3 (one GPU, ranks sharing GPU 0): bench before (2b4aace,
# "old") and after ("new") in one command for what the change touched:
# every allreduce algorithm (eager calls take device turns), the
# all-gather (escape words); 4 and 8 ranks in one process, 2 processes
# under MPS. Model-only `auto` on both sides (TP_ALLREDUCE_AUTO_MEASURE=off),
# then the new build's measured `auto`: cold (measures), warm (cache).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
L=$OUT; S=$OUT/summary.txt; mkdir -p /tmp/b /tmp/logs
run() { local name=$1 lim=$2; shift 2; local t=$SECONDS; timeout $lim "$@" > /tmp/logs/$name.log 2>&1; local rc=$?; echo "$name rc=$rc $((SECONDS-t))s" | tee -a $S; }
nvidia-smi -L | tee -a $S
/opt/torch/.venv/bin/python3 -c "
import lzma, os
for f in os.listdir('.carry/bin'):
    n = f[:-3]
    if n.startswith('tpa'): open('/tmp/b/' + n, 'wb').write(lzma.open('.carry/bin/' + f).read()); os.chmod('/tmp/b/' + n, 0o755)
"
export TP_ALLREDUCE_TUNING_FILE=/tmp/none.toml TP_ALLREDUCE_AUTO_MEASURE=off
SZ=4K,42K,256K,1M,8M
for v in old new; do
  B="/tmp/b/tpa-$v bench --gpus 0 --repeats 10 --no-verify-pass"; [[ $v == new ]] && B="/tmp/b/tpa bench --gpus 0 --repeats 10 --no-verify-pass"
  run r4-$v 60 $B --ranks-per-gpu 4 --sizes $SZ --algorithms all
  run r8-$v 60 $B --ranks-per-gpu 8 --island-size 4 --sizes $SZ --algorithms one-shot-push,two-shot-push,hierarchical,pipelined-hierarchical,auto
  run ag4-$v 40 $B --ranks-per-gpu 4 --collective all-gather --sizes 4K,42K,256K,1M --algorithms auto
done
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d
for v in old new; do
  bin=/tmp/b/tpa-old; [[ $v == new ]] && bin=/tmp/b/tpa
  CUDA_DEVICE_MAX_CONNECTIONS=2 run mps2-$v 90 $bin bench --processes --gpus 0 --ranks-per-gpu 2 --repeats 10 --no-verify-pass --sizes $SZ --algorithms all
done
# Measured auto (new build): a cold start measures, a second start loads the cache.
unset TP_ALLREDUCE_AUTO_MEASURE; export TP_ALLREDUCE_CACHE_DIR=/tmp/tpa-cache
CUDA_DEVICE_MAX_CONNECTIONS=2 run mps2-measured-cold 120 /tmp/b/tpa bench --processes --gpus 0 --ranks-per-gpu 2 --repeats 10 --no-verify-pass --sizes $SZ --algorithms all
CUDA_DEVICE_MAX_CONNECTIONS=2 run mps2-measured-warm 90 /tmp/b/tpa bench --processes --gpus 0 --ranks-per-gpu 2 --repeats 10 --no-verify-pass --sizes $SZ --algorithms all
echo quit | nvidia-cuda-mps-control
run r8-measured-cold 120 /tmp/b/tpa bench --gpus 0 --ranks-per-gpu 8 --island-size 4 --repeats 10 --no-verify-pass --sizes $SZ --algorithms one-shot-push,two-shot-push,hierarchical,pipelined-hierarchical,auto
run r8-measured-warm 90 /tmp/b/tpa bench --gpus 0 --ranks-per-gpu 8 --island-size 4 --repeats 10 --no-verify-pass --sizes $SZ --algorithms one-shot-push,two-shot-push,hierarchical,pipelined-hierarchical,auto
run plan-measured 30 /tmp/b/tpa plan --world 8 --ranks-per-gpu 8 --measured /tmp/tpa-cache
tar czf $OUT/bench-logs.tgz -C /tmp logs
for f in /tmp/logs/*.log; do echo "== $f"; grep -avE '^\s*$' $f | tail -n 14; done > $OUT/tails.txt
