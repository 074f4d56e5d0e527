#!/usr/bin/env bash
# The speed experiment of issue 14, as one device command on 2 GPUs:
#   1. correctness smoke: the GPU wrap test (every algorithm across the u32
#      counter wrap), the one-shot-push matrix and any-shape tests, timeouts;
#   2. new vs old `bench --processes --gpus 0,1` at 4K..8M (new with
#      --trace; the two-rank kernel and the generic one), NCCL alongside;
#   3. the FlashInfer peer benchmark (nccl, torch symm_mem, fi_seed, fi_best);
#   4. `tune --shapes full` (every algorithm, one-shot-push launch shapes);
#   5. the tuned table: bench auto vs NCCL plus the verify pass;
#   6. 8 ranks on GPU 0 under MPS at 4K/42K/64K, new and old.
# Every step is bounded (its own limit and a global budget); the last step
# that does not fit is skipped and says so. Prints a summary table.
#
# Build here first (bash .ci/build-dev.sh): .dev/tp-allreduce (this tree),
# .dev/tp-allreduce-old (the binary to compare with), .dev/suite (the test
# binary), .peers/flashinfer-pcie. Then, on the GPU machine, from the
# repository root:  OUT=<dir> bash .ci/speed-exp.sh
# $OUT receives 6 files: summary.txt, log.txt, speed-exp.tar.gz (every log
# and JSON), tuning.toml, sweep.json, peer_bench.json.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export TP_ALLREDUCE_TIMEOUT_MS=5000
OUT=${OUT:-results/speed-exp}
BUDGET=${BUDGET:-500}          # seconds for all steps together
SIZES=${SIZES:-4K,16K,42K,64K,256K,1M,8M}
NEW=.dev/tp-allreduce OLD=.dev/tp-allreduce-old SUITE=.dev/suite PEER=.peers/flashinfer-pcie/run_peer_bench.py
mkdir -p "$OUT"
W=$(mktemp -d /tmp/speed-exp.XXXXXX)
source .ci/steps.sh
# Untuned steps must not find a cached table.
export TP_ALLREDUCE_TUNING_FILE=$W/no-tuning-table.toml

nvidia-smi --query-gpu=index,name,driver_version --format=csv > "$W/gpus.txt" 2>&1
nvidia-smi topo -m > "$W/topo.txt" 2>&1
for f in "$NEW" "$OLD" "$SUITE" "$PEER"; do [ -e "$f" ] || echo "missing: $f (run bash .ci/build-dev.sh)" | tee -a "$LOG"; done

# 1. Correctness first: nothing else counts if it fails.
step smoke 110 env TP_ALLREDUCE_REQUIRE_GPU=1 "$SUITE" --test-threads=1 \
  gpu_wrap:: gpu_allreduce::one_shot_push gpu_timeout::

# 2. New vs old, one process per GPU, graph replay, same sizes as the peer.
B="bench --processes --gpus 0,1 --sizes $SIZES --repeats 10 --no-verify-pass"
step new 70 "$NEW" $B --algorithms auto,one-shot-push,two-shot-push,nccl --trace --out "$W/new"
step new-generic 40 env TP_ALLREDUCE_ONE_SHOT_PUSH_TP2=0 "$NEW" $B --algorithms one-shot-push --trace --out "$W/new-generic"
step old 70 "$OLD" $B --algorithms auto,one-shot-push,two-shot-push,nccl --out "$W/old"

# 3. FlashInfer's PCIe-IPC all-reduce (seed and swept configs), torch
#    symm_mem and NCCL on the same GPUs.
step peer 120 python3 "$PEER" --backends nccl,symm_1shot,symm_1shot_copy,fi_seed,fi_best \
  --total-timeout 110 --json "$W/peer/peer_bench.json"

# 4. Launch-shape sweep (verified candidates, slowest rank, ties -> fewer threads).
step tune 100 "$NEW" tune --gpus 0,1 --sizes "$SIZES" --shapes full --out "$W/tuning.toml" --report "$W/sweep.json"

# 5. The tuned table: auto vs NCCL and the verify pass (122 x 42 KB + a dependent kernel).
if [ -f "$W/tuning.toml" ]; then
  step tuned 70 env TP_ALLREDUCE_TUNING_FILE="$W/tuning.toml" "$NEW" bench --processes --gpus 0,1 --sizes "$SIZES" \
    --repeats 10 --algorithms auto,one-shot-push,nccl --out "$W/tuned"
fi

# 6. 8 ranks on GPU 0 (processes sharing a GPU need MPS).
if mps_start; then
  # MPS caps connections across its clients: 2 per process for 8 processes.
  export CUDA_DEVICE_MAX_CONNECTIONS=2
  M="bench --processes --gpus 0 --ranks-per-gpu 8 --sizes 4K,42K,64K --repeats 10 --no-verify-pass"
  step mps8-new 50 "$NEW" $M --algorithms auto,one-shot-push --trace --out "$W/mps8-new"
  step mps8-old 50 "$OLD" $M --algorithms auto,one-shot-push --out "$W/mps8-old"
  mps_stop
  export CUDA_DEVICE_MAX_CONNECTIONS=32
else
  echo "=== mps8: MPS did not start, skipped" | tee -a "$LOG"
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

def rows(rep):
    return {} if not rep else {(m["bytes"], m["selection"]): m["median_us"] for m in rep.get("measurements", [])}

new, gen, old, tuned = (rows(load(p)) for p in ("new/results.json", "new-generic/results.json",
                                                  "old/results.json", "tuned/results.json"))
peer = load("peer/peer_bench.json") or {}
fi = {(r["backend"], r["size_bytes"]): r.get("median_us") for r in peer.get("results", []) if "median_us" in r}
sizes = sorted({b for (b, _) in list(new) + list(old) + list(tuned)} | {s for (_, s) in fi})

def f(v):
    return "-" if v is None or v != v else f"{v:.2f}"

def line(cells, widths):
    return "  ".join(str(c).rjust(n) for c, n in zip(cells, widths))

print("speed experiment: median us per allreduce, bf16, 2 GPUs, graph replay (slowest rank)")
head = ["size", "tuned", "new:auto", "new:1sp", "generic", "new:2sp", "old:auto", "old:1sp", "nccl", "fi_seed",
        "fi_best", "symm1", "target", "tuned/fi"]
wid = [7, 6, 8, 7, 7, 7, 8, 7, 6, 7, 7, 6, 6, 8]
print(line(head, wid))
for b in sizes:
    best_fi = min([v for v in (fi.get(("fi_seed", b)), fi.get(("fi_best", b))) if v] or [float("nan")])
    t = tuned.get((b, "auto"))
    label = f"{b >> 20}M" if b >= 1 << 20 else f"{b >> 10}K"
    print(line([label, f(t), f(new.get((b, "auto"))), f(new.get((b, "one-shot-push"))),
                f(gen.get((b, "one-shot-push"))), f(new.get((b, "two-shot-push"))), f(old.get((b, "auto"))),
                f(old.get((b, "one-shot-push"))), f(new.get((b, "nccl")) or tuned.get((b, "nccl"))),
                f(fi.get(("fi_seed", b))), f(fi.get(("fi_best", b))), f(fi.get(("symm_1shot", b))),
                f(0.95 * best_fi), f(t / best_fi if t and best_fi == best_fi else None)], wid))

for name in ("new", "new-generic", "mps8-new"):
    rep = load(f"{name}/results.json")
    if rep and rep.get("trace"):
        print(f"\ntrace of {name} (medians, us): gap = previous exit -> entry, store = entry -> first peer store, "
              "wait = first store -> last poll, tail = last poll -> exit")
        print(line(["size", "selection", "rank", "shape", "gap", "loaded", "store", "wait", "tail", "kernel"],
                   [7, 14, 4, 8, 6, 6, 6, 6, 6, 6]))
        for s in rep["trace"]:
            print(line([s["bytes"], s["selection"], s["rank"], s["shape"], f(s["gap_us"]), f(s["loaded_us"]),
                        f(s["first_store_us"]), f(s["wait_us"]), f(s["tail_us"]), f(s["kernel_us"])],
                       [7, 14, 4, 8, 6, 6, 6, 6, 6, 6]))

rep = load("tuned/results.json")
for v in (rep or {}).get("verify_pass", []):
    print(f"\nverify pass ({v['selection']}, {v['algorithm']}): {v['median_ms']:.3f} ms, "
          f"{v['per_allreduce_us']:.2f} us per allreduce (target 0.50 ms)")

m8n, m8o = rows(load("mps8-new/results.json")), rows(load("mps8-old/results.json"))
if m8n or m8o:
    print("\n8 ranks on GPU 0 (MPS), median us: size, new auto, new one-shot-push, old auto, old one-shot-push "
          "(target <= 6 us at 42 KB)")
    for b in sorted({b for (b, _) in list(m8n) + list(m8o)}):
        print(line([b, f(m8n.get((b, "auto"))), f(m8n.get((b, "one-shot-push"))), f(m8o.get((b, "auto"))),
                    f(m8o.get((b, "one-shot-push")))], [7, 8, 8, 8, 8]))

sweep = load("sweep.json") or []
if sweep:
    print("\nshape sweep: best (blocks x threads) per size")
    for b in sorted({p["bytes"] for p in sweep}):
        pts = sorted((p for p in sweep if p["bytes"] == b), key=lambda p: p["median_us"])[:3]
        print(f"  {b:>8}: " + ", ".join(f"{p['blocks']}x{p['threads']} {p['median_us']:.2f}" for p in pts))

print("\nsteps (name, exit status, seconds):")
try:
    print(open(os.path.join(w, "steps.txt")).read().rstrip())
except Exception:
    pass
PY
cat "$W/summary.txt" | tee -a "$LOG"
cp "$W/summary.txt" "$LOG" "$OUT/"
for f in tuning.toml sweep.json peer/peer_bench.json; do [ -f "$W/$f" ] && cp "$W/$f" "$OUT/"; done
tar -czf "$OUT/speed-exp.tar.gz" -C "$W" . 2>/dev/null
echo "total $((SECONDS - START)) s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
