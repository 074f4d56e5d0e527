#!/usr/bin/env bash
# Our allreduce against its peers, as one command on a 2-GPU machine (run
# the GPU suites first, benches/gpu/gpu-suite.sh, for correctness):
#   1. ours (new) vs NCCL, one process per GPU, graph replay, with --trace;
#   2. FlashInfer's PCIe-IPC allreduce (its pip package, flashinfer-python:
#      benches/gpu/flashinfer_peer.py says what to install) and NCCL, same GPUs;
#   3. `tune --shapes full`, then the tuned table with the verify pass;
#   4. 8 ranks on GPU 0 (MPS);
#   5. the fused epilogue (3 x 7168 bf16) and its verify pass;
#   6. 4 ranks on 2 GPUs (MPS): hierarchical 2+2 vs two-shot push; the
#      copy-engine ring vs one-shot push and NCCL over NVLink;
#   7. the Python package's GPU tests and decode step (.dev/wheels).
# Every step is bounded; what does not fit the budget is skipped and says so.
# Build here first (bash benches/gpu/build-dev.sh), then on the GPU machine,
# from the repository root:
#   OUT=<dir> bash benches/gpu/vs-peers.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-results/vs-peers}
BUDGET=${BUDGET:-540}
SIZES=${SIZES:-4K,16K,42K,64K,256K,1M,8M}
NEW=.dev/tp-allreduce PEER=benches/gpu/flashinfer_peer.py
mkdir -p "$OUT"
W=$(mktemp -d /tmp/vs-peers.XXXXXX)
source benches/gpu/steps.sh
export TP_ALLREDUCE_TUNING_FILE=$W/no-tuning-table.toml
nvidia-smi --query-gpu=index,name,driver_version --format=csv > "$W/gpus.txt" 2>&1

B="bench --processes --gpus 0,1 --repeats 10"
step new 60 "$NEW" $B --sizes "$SIZES" --no-verify-pass --algorithms auto,one-shot-push,two-shot-push,nccl \
  --trace --out "$W/new"
if python3 -c "import flashinfer.comm" > "$W/flashinfer-import.log" 2>&1; then
  step peer 100 python3 "$PEER" --sizes "$SIZES" --backends nccl,fi_seed,fi_best --json "$W/peer/peer_bench.json"
else
  echo "=== peer: skipped: \`import flashinfer.comm\` failed ($(tail -n 1 "$W/flashinfer-import.log")); install flashinfer-python==0.7.2.post1 (see $PEER)" | tee -a "$LOG"
  echo "peer skipped 0" >> "$W/steps.txt"
fi
step tune 60 "$NEW" tune --gpus 0,1 --sizes "$SIZES" --shapes full --out "$W/tuning.toml" --report "$W/sweep.json"
[ -f "$W/tuning.toml" ] && step tuned 60 env TP_ALLREDUCE_TUNING_FILE="$W/tuning.toml" "$NEW" $B --sizes "$SIZES" \
  --algorithms auto,nccl --out "$W/tuned"
step fused 90 "$NEW" $B --sizes 42K --dtype bf16 --fused --fused-shape 3x7168 --algorithms auto,nccl --out "$W/fused"
step ce 50 "$NEW" $B --sizes 1M,8M,64M --no-verify-pass --algorithms copy-engine-ring,one-shot-push,nccl --out "$W/ce"
if mps_start; then
  export CUDA_DEVICE_MAX_CONNECTIONS=2
  step mps8 40 "$NEW" bench --processes --gpus 0 --ranks-per-gpu 8 --sizes 4K,42K,64K --repeats 10 --no-verify-pass \
    --algorithms auto,one-shot-push,two-shot-push --trace --out "$W/mps8"
  step mps4 50 "$NEW" bench --processes --gpus 0,1 --ranks-per-gpu 2 --island-size 2 --sizes 42K,256K,1M,8M \
    --repeats 10 --no-verify-pass --algorithms hierarchical,two-shot-push,one-shot-push --out "$W/mps4"
  mps_stop
  export CUDA_DEVICE_MAX_CONNECTIONS=32
fi
if ls .dev/wheels/tp_allreduce-*.whl > /dev/null 2>&1; then
  step python 170 env OUT="$W/python" bash python/run-gpu-checks.sh .dev/wheels
fi

python3 - "$W" > "$W/summary.txt" 2>&1 <<'PY'
import json, os, sys
w = sys.argv[1]

def load(path):
    try:
        with open(os.path.join(w, path)) as f:
            return json.load(f)
    except Exception:
        return None

def rows(path):
    rep = load(path)
    return {} if not rep else {(m["bytes"], m["selection"]): m["median_us"] for m in rep.get("measurements", [])}

def f(v):
    return "-" if v is None or v != v else f"{v:.2f}"

def label(b):
    return f"{b >> 20}M" if b >= 1 << 20 else f"{b >> 10}K"

new, tuned = rows("new/results.json"), rows("tuned/results.json")
peer = load("peer/peer_bench.json") or {}
fi = {(r["backend"], r["size_bytes"]): r.get("median_us") for r in peer.get("results", []) if "median_us" in r}
sizes = sorted({b for (b, _) in list(new) + list(tuned)})
print("median us per allreduce, bf16, 2 GPUs, graph replay (slowest rank)")
print(f"{'size':>6} {'tuned':>7} {'auto':>7} {'1-push':>7} {'2-push':>7} {'nccl':>7} {'fi_seed':>8} {'fi_best':>8} "
      f"{'x fi':>6} {'x nccl':>7}")
for b in sizes:
    best = min([v for v in (fi.get(("fi_seed", b)), fi.get(("fi_best", b))) if v] or [float("nan")])
    t = tuned.get((b, "auto"))
    nccl = tuned.get((b, "nccl")) or new.get((b, "nccl"))
    print(f"{label(b):>6} {f(t):>7} {f(new.get((b, 'auto'))):>7} {f(new.get((b, 'one-shot-push'))):>7} "
          f"{f(new.get((b, 'two-shot-push'))):>7} {f(nccl):>7} {f(fi.get(('fi_seed', b))):>8} "
          f"{f(fi.get(('fi_best', b))):>8} "
          f"{f(t / best if t and best == best else None):>6} {f(nccl / t if t and nccl else None):>7}")
for name in ("tuned", "fused"):
    for v in (load(f"{name}/results.json") or {}).get("verify_pass", []):
        print(f"verify pass ({name}: {v['selection']}, {v['algorithm']}): {v['median_ms']:.3f} ms")
fused = load("fused/results.json") or {}
for key in ("fused", "fused_rows", "fused_measurements"):
    if fused.get(key):
        print(f"fused: {json.dumps(fused[key])[:1500]}")
for name in ("mps8", "mps4", "ce"):
    r = rows(f"{name}/results.json")
    if r:
        print(f"\n{name}: " + ", ".join(f"{label(b)} {s} {f(v)}" for (b, s), v in sorted(r.items())))
print("\nsteps (name, exit status, seconds):")
try:
    print(open(os.path.join(w, "steps.txt")).read().rstrip())
except Exception:
    pass
PY
cat "$W/summary.txt" | tee -a "$LOG"
cp "$W/summary.txt" "$LOG" "$OUT/"
for f in tuning.toml sweep.json peer/peer_bench.json; do [ -f "$W/$f" ] && cp "$W/$f" "$OUT/"; done
tar -czf "$OUT/vs-peers.tar.gz" -C "$W" . 2>/dev/null
echo "total $((SECONDS - START)) s"
