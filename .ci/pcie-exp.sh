#!/usr/bin/env bash
# The PCIe-family experiment of issue 15, as one device command on 2 GPUs:
#   1. correctness smoke: the new waits' timeouts, hierarchical 2+2 over the
#      two GPUs, the per-pair transport (test hook), the copy-engine ring's
#      kernel publication;
#   2. 4 ranks on 2 GPUs (2 per GPU, MPS): hierarchical (islands of 2: the
#      GPUs) vs two-shot push (both payload completion) vs auto, 42 KB..8 MB;
#   3. the copy-engine ring vs one-shot push, the SM ring and NCCL over
#      NVLink, one process per GPU, 1..64 MB.
# Every step is bounded (its own limit and a global budget). Prints a
# summary table; JSON results of every bench go to $OUT.
#
# Build here first (bash .ci/build-dev.sh, OLD_REV=none is enough): .dev/tp-allreduce,
# .dev/suite. Then, on the GPU machine, from the repository root:
#   OUT=<dir> bash .ci/pcie-exp.sh
# $OUT receives summary.txt, log.txt, pcie-exp.tar.gz (every log and JSON),
# mps4.json, ce.json.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32 TP_ALLREDUCE_TIMEOUT_MS=5000
OUT=${OUT:-results/pcie-exp}
BUDGET=${BUDGET:-500}
NEW=.dev/tp-allreduce SUITE=.dev/suite
mkdir -p "$OUT"
W=$(mktemp -d /tmp/pcie-exp.XXXXXX)
source .ci/steps.sh   # step, kill_tree, LOG, the NCCL library, the NVLS switches
# No tuning table: the model's selection (what a fresh install does).
export TP_ALLREDUCE_TUNING_FILE=$W/no-tuning-table.toml

nvidia-smi --query-gpu=index,name,driver_version --format=csv > "$W/gpus.txt" 2>&1
nvidia-smi topo -m > "$W/topo.txt" 2>&1
for f in "$NEW" "$SUITE"; do [ -e "$f" ] || echo "missing: $f (run bash .ci/build-dev.sh)" | tee -a "$LOG"; done

# 1. Correctness first.
step smoke 150 env TP_ALLREDUCE_REQUIRE_GPU=1 "$SUITE" --test-threads=1 \
  gpu_pcie_family::new_waits gpu_pcie_family::hierarchical_two_plus_two gpu_pcie_family::per_pair_transport_runs \
  gpu_pcie_family::copy_engine_ring_with_kernel_publication

# 2. 4 ranks on 2 GPUs, 2 per GPU (processes sharing a GPU need MPS).
if mps_start; then
  step mps4 150 "$NEW" bench --processes --gpus 0,1 --ranks-per-gpu 2 --island-size 2 \
    --sizes 42K,64K,256K,1M,2M,8M --repeats 10 --no-verify-pass \
    --algorithms hierarchical,two-shot-push,one-shot-push,auto --out "$W/mps4"
  mps_stop
else
  echo "=== mps4: MPS did not start, skipped" | tee -a "$LOG"
fi

# 3. The copy-engine ring over NVLink, one process per GPU.
step ce 150 "$NEW" bench --processes --gpus 0,1 --sizes 1M,2M,4M,8M,16M,32M,64M --repeats 10 --no-verify-pass \
  --algorithms copy-engine-ring,one-shot-push,ring,nccl --out "$W/ce"

python3 - "$W" > "$W/summary.txt" 2>&1 <<'PY'
import json, os, sys
w = sys.argv[1]

def rows(path):
    try:
        with open(os.path.join(w, path)) as f:
            rep = json.load(f)
    except Exception:
        return {}
    return {(m["bytes"], m["selection"]): m["median_us"] for m in rep.get("measurements", [])}

def f(v):
    return "-" if v is None or v != v else f"{v:.2f}"

def label(b):
    return f"{b >> 20}M" if b >= 1 << 20 else f"{b >> 10}K"

def table(title, data, cols, ratio):
    print(title)
    print("  ".join(c.rjust(16) for c in ["size"] + cols + [f"{ratio[0]}/{ratio[1]}"]))
    for b in sorted({b for (b, _) in data}):
        r = data.get((b, ratio[0])), data.get((b, ratio[1]))
        q = r[0] / r[1] if r[0] and r[1] else None
        print("  ".join(c.rjust(16) for c in [label(b)] + [f(data.get((b, c))) for c in cols] + [f(q)]))
    print()

table("4 ranks on 2 GPUs (2 per GPU, MPS), islands of 2, bf16 graph replay, median us (issue 15: "
      "hierarchical <= two-shot-push at 42 KB)", rows("mps4/results.json"),
      ["hierarchical", "two-shot-push", "one-shot-push", "auto"], ("hierarchical", "two-shot-push"))
table("2 ranks over NVLink (one process per GPU), median us: the copy-engine ring against SM pushes "
      "(meant for PCIe; where it wins or loses here)", rows("ce/results.json"),
      ["copy-engine-ring", "one-shot-push", "ring", "nccl"], ("copy-engine-ring", "one-shot-push"))
print("steps (name, exit status, seconds):")
try:
    print(open(os.path.join(w, "steps.txt")).read().rstrip())
except Exception:
    pass
PY
cat "$W/summary.txt" | tee -a "$LOG"
cp "$W/summary.txt" "$LOG" "$OUT/"
[ -f "$W/mps4/results.json" ] && cp "$W/mps4/results.json" "$OUT/mps4.json"
[ -f "$W/ce/results.json" ] && cp "$W/ce/results.json" "$OUT/ce.json"
tar -czf "$OUT/pcie-exp.tar.gz" -C "$W" . 2>/dev/null
echo "total $((SECONDS - START)) s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
