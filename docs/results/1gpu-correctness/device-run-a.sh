#!/usr/bin/env bash
# Device run A (one GPU, ranks sharing GPU 0): issue 35's tests on the
# build before the change (2b4aace, "old": the new tests compiled against
# the old library) and after ("new"), then bench before/after in the same
# command for the algorithms the change touched (all-gather push; every
# allreduce algorithm's eager path now takes its device turn).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
L=/tmp/logs; mkdir -p $L /tmp/b; S=$OUT/summary.txt
run() { local name=$1 lim=$2; shift 2; local t=$SECONDS; timeout $lim "$@" > $L/$name.log 2>&1; local rc=$?; echo "$name rc=$rc $((SECONDS-t))s" | tee -a $S; }
nvidia-smi -L | tee -a $S
/opt/torch/.venv/bin/python3 -c "
import lzma, os
for f in os.listdir('.carry/bin'):
    n = f[:-3]; open('/tmp/b/' + n, 'wb').write(lzma.open('.carry/bin/' + f).read()); os.chmod('/tmp/b/' + n, 0o755)
"
export TP_ALLREDUCE_TUNING_FILE=/tmp/none.toml TP_ALLREDUCE_REQUIRE_GPU=1
T="gpu_collectives::all_gather_copies_every_bit_pattern gpu_concurrent:: cli::bench_checks_each_call_against_the_algorithm_that_ran"
# Before: each test is expected to fail (a timeout is a failure too).
run old-tests 200 env TP_ALLREDUCE_BIN=/tmp/b/tpa-old /tmp/b/suite-old --test-threads=1 $T
run new-tests 300 env TP_ALLREDUCE_BIN=/tmp/b/tpa /tmp/b/suite --test-threads=1 --nocapture $T
for f in old-tests new-tests; do grep -hE "^test |test result|panicked|checked|: ok$" $L/$f.log | head -n 40 | sed "s/^/$f: /" | tee -a $S; done
# Bench before/after, same command: 4 and 8 ranks in one process.
for v in old new; do
  bin=/tmp/b/tpa; [[ $v == old ]] && bin=/tmp/b/tpa-old
  B="$bin bench --gpus 0 --repeats 10 --no-verify-pass"
  run bench4-$v 60 $B --ranks-per-gpu 4 --sizes 4K,42K,256K,1M,8M --algorithms all --out $L/bench4-$v
  run bench8-$v 60 $B --ranks-per-gpu 8 --island-size 4 --sizes 4K,42K,256K,1M,8M --algorithms one-shot-push,two-shot-push,hierarchical,auto --out $L/bench8-$v
  run ag4-$v 40 $B --ranks-per-gpu 4 --collective all-gather --sizes 4K,42K,1M --algorithms auto --out $L/ag4-$v
done
tar czf $OUT/logs.tgz -C /tmp logs
