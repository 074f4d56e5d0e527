#!/usr/bin/env bash
# The fused epilogue (allreduce + residual add + RMSNorm), as one command
# on a 2-GPU machine:
#   1. correctness: the fused GPU tests across the two GPUs (eager matrix,
#      1000 graph replays, bad arguments, edge cases), then the one-GPU
#      matrices (2-8 ranks sharing GPU 0, one-shot push and pull);
#   2. `bench --processes --gpus 0,1 --fused`: bf16, 3 x 7168 (42 KB), graph
#      replay: fused vs allreduce alone vs allreduce + separate kernel vs
#      NCCL + separate kernel, and the verify pass (122 layers) of each;
#   3. the same with thread-block clusters off (the block-per-row kernels
#      older GPUs run), `auto` at 64 x 7168 (917 KB); with ISLAND=1 also
#      one-shot-push forced, and two-shot-push forced (its fused kernel) at
#      3 x 7168 and 64 x 7168.
#   TESTS=0 skips step 1 (when benches/gpu/gpu-suite.sh runs the same tests).
# Every step is bounded (its own limit and a global budget). Writes
# $OUT/summary.json (the figures against the targets set in the script),
# $OUT/summary.txt, $OUT/log.txt and $OUT/fused.tar.gz (every log and
# results.json).
#
# Build here first:  bash benches/gpu/build-dev.sh
# (.dev/tp-allreduce and .dev/suite), then on the GPU machine, from the
# repository root:  OUT=<dir> bash benches/gpu/fused.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_DEVICE_MAX_CONNECTIONS=32 TP_ALLREDUCE_TIMEOUT_MS=5000
OUT=${OUT:-results/fused}
BUDGET=${BUDGET:-575}          # seconds for all steps together
B=.dev/tp-allreduce SUITE=.dev/suite
mkdir -p "$OUT"
W=$(mktemp -d /tmp/fused.XXXXXX)
source benches/gpu/steps.sh   # step, kill_tree, LOG, the NCCL library, the NVLS switches
# No tuning table: the model's selection (what a fresh install does).
export TP_ALLREDUCE_TUNING_FILE=$W/no-tuning-table.toml

nvidia-smi --query-gpu=index,name,driver_version --format=csv > "$W/gpus.txt" 2>&1
nvidia-smi topo -m > "$W/topo.txt" 2>&1
for f in "$B" "$SUITE"; do [ -x "$f" ] || echo "missing: $f (run bash benches/gpu/build-dev.sh)" | tee -a "$LOG"; done

# 1. Correctness first (TESTS=0 skips it when benches/gpu/gpu-suite.sh runs them).
T="env TP_ALLREDUCE_REQUIRE_GPU=1 TP_ALLREDUCE_REQUIRE_GPUS=2 $SUITE --test-threads=1"
if [ "${TESTS:-1}" = 1 ]; then
  step tests-2gpu 130 $T gpu_fused::fused_two_ranks_on_two_gpus gpu_fused_graph::fused_graph_replays_two_gpus \
    gpu_fused::fused_calls_refuse_bad_arguments gpu_fused::fused_edge_cases gpu_fused::fused_world_of_one
  step tests-1gpu 300 $T gpu_fused::fused_one_shot_push_matrix gpu_fused::fused_one_shot_pull_matrix \
    gpu_fused::fused_two_shot_push_matrix gpu_fused::fused_hierarchical_matrix \
    gpu_fused::fused_calls_on_every_algorithm gpu_fused_graph::fused_graph_replays_one_gpu \
    gpu_fused_graph::fused_island_graph_replays gpu_timeout::missing_rank_times_out_in_fused_calls \
    gpu_foundation::embedded_ptx_for_this_device_loads
fi

# 2. The targets: one process per GPU, graph replay, bf16, 3 x 7168, with
#    the in-kernel trace of each variant (where the time goes).
F="bench --processes --gpus 0,1 --sizes 42K --dtype bf16 --repeats 20 --fused --fused-shape 3x7168"
step bench 120 "$B" $F --algorithms auto,nccl --trace --out "$W/bench"
# The block-per-row kernels (what GPUs before sm_90 run), for comparison
# with the thread-block clusters the default takes on sm_90+.
step bench-noclusters 100 env TP_ALLREDUCE_FUSED_CLUSTERS=0 "$B" $F --algorithms auto --trace \
  --out "$W/bench-noclusters"
F64="bench --processes --gpus 0,1 --sizes 896K --dtype bf16 --repeats 20 --fused --fused-shape 64x7168 --no-verify-pass"
step bench64 80 "$B" $F64 --algorithms auto --out "$W/bench64"
# 3. The fused TwoShotPush (forced), at 3 rows and at 64 rows (917 KB)
#    (ISLAND=1; their fused kernels are opt-in:
#    TP_ALLREDUCE_FUSED_ISLAND_KERNELS=1).
if [ "${ISLAND:-0}" = 1 ]; then
  step bench-1sp 80 "$B" $F --algorithms one-shot-push --out "$W/bench-1sp" --no-verify-pass
  step bench-2sp 80 env TP_ALLREDUCE_FUSED_ISLAND_KERNELS=1 "$B" $F --algorithms two-shot-push \
    --out "$W/bench-2sp" --no-verify-pass
  step bench64-2sp 80 env TP_ALLREDUCE_FUSED_ISLAND_KERNELS=1 "$B" $F64 --algorithms two-shot-push \
    --out "$W/bench64-2sp"
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

def steps():
    try:
        return [l.split() for l in open(os.path.join(w, "steps.txt")).read().split("\n") if l.strip()]
    except Exception:
        return []

summary = {"targets": {"fused_minus_allreduce_us_max": 0.5, "saved_vs_ours_separate_us_min": 1.5,
                       "fused_verify_pass_ms_max": 0.55},
           "steps": [{"name": s[0], "status": s[1], "seconds": int(s[2])} for s in steps() if len(s) == 3]}
for name in ("bench", "bench-noclusters", "bench-1sp", "bench-2sp", "bench64", "bench64-2sp"):
    rep = load(f"{name}/results.json")
    if not rep:
        continue
    per = {r["variant"]: r for r in rep.get("fused", [])}
    med = {k: v["median_us"] for k, v in per.items()}
    ar = {(m["selection"]): m["median_us"] for m in rep.get("measurements", [])}
    res = {"gpu": rep.get("gpu_model"), "world": rep.get("world"), "rows": per,
           "allreduce_rows_us": ar, "verify_pass": rep.get("verify_pass", [])}
    if "fused" in med and "allreduce" in med:
        res["fused_minus_allreduce_us"] = med["fused"] - med["allreduce"]
        res["fused_minus_allreduce_ok"] = res["fused_minus_allreduce_us"] <= 0.5
    if "fused" in med and "ours+separate" in med:
        res["saved_vs_ours_separate_us"] = med["ours+separate"] - med["fused"]
        res["saved_vs_ours_separate_ok"] = res["saved_vs_ours_separate_us"] >= 1.5
    if "fused" in med and "nccl+separate" in med:
        res["saved_vs_nccl_separate_us"] = med["nccl+separate"] - med["fused"]
    for v in rep.get("verify_pass", []):
        if v["selection"] == "fused":
            res["fused_verify_pass_ms"] = v["median_ms"]
            res["fused_verify_pass_ok"] = v["median_ms"] <= 0.55
    summary[name] = res

print(json.dumps(summary, indent=1))
with open(os.path.join(w, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
for name in ("bench", "bench-noclusters", "bench-1sp", "bench-2sp", "bench64", "bench64-2sp"):
    r = summary.get(name)
    if not r:
        print(f"\n{name}: no results")
        continue
    print(f"\n{name}: per layer, us (median [p10 - p90]), {r['gpu']}, {r['world']} ranks")
    for v, row in r["rows"].items():
        print(f"  {v:<14} {row['median_us']:7.2f} [{row['p10_us']:.2f} - {row['p90_us']:.2f}]  {row['ran']}")
    for k in ("fused_minus_allreduce_us", "saved_vs_ours_separate_us", "saved_vs_nccl_separate_us", "fused_verify_pass_ms"):
        if k in r:
            print(f"  {k}: {r[k]:.3f}  ok={r.get(k.replace('_us', '_ok').replace('_ms', '_ok'), '-')}")
    for v in r["verify_pass"]:
        print(f"  verify pass {v['selection']:<14} {v['median_ms']:.3f} ms ({v['algorithm']})")
PY
cat "$W/summary.txt" | tee -a "$LOG"
cp "$W/summary.txt" "$LOG" "$OUT/"
[ -f "$W/summary.json" ] && cp "$W/summary.json" "$OUT/"
tar -czf "$OUT/fused.tar.gz" -C "$W" . 2>/dev/null
echo "total $((SECONDS - START)) s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
