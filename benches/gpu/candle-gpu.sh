#!/usr/bin/env bash
# The candle example on 2 GPUs: a 61-layer tensor-parallel stack
# in candle, tp-allreduce's candle ops against the cudarc NCCL op in the
# same run (step time, max abs diff; non-zero exit beyond bf16 tolerance),
# and, when its binary was brought along, the suite's candle GPU tests.
#
# Build here, run there (the GPU machine has no Rust toolchain):
#   bash benches/gpu/candle-gpu.sh --build        # here: release launcher, release
#       example (sm_90), suite binary -> .dev/ (the last two xz-compressed, 13 MB)
#   OUT=<results dir> bash benches/gpu/candle-gpu.sh   # there, from the repository root
#
# The binaries link the CUDA libraries (candle-core's cudarc uses
# `dynamic-linking`): libcuda.so.1 (driver), libnccl.so.2, libcublas.so.13
# (and libcublasLt.so.13), libcurand.so.10, libcudart.so.13. This
# script looks for them in PyTorch's NVIDIA wheels (site-packages/nvidia/...)
# and the CUDA toolkit (/usr/local/cuda) and says which are missing.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [ "${1:-}" = "--build" ]; then
  set -e
  # --target: one candle-kernels build shared by the example and the suite.
  TARGET=$(rustc -vV | sed -n 's/^host: //p')
  DIR=${CARGO_TARGET_DIR:-target}
  cargo build --release --bin tp-allreduce
  eval "$(bash .ci/candle-toolkit.sh --env)"   # CUDA_COMPUTE_CAP=90 unless set
  cargo build --release --target "$TARGET" --no-default-features --features candle --example candle_tp
  suite=$(cargo test --target "$TARGET" --features candle --test suite --no-run --message-format=json |
    python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and m["target"]["name"] == "suite"][-1])')
  # Stripped and xz-compressed (48 MB -> 6 MB, 55 -> 7): the device
  # machine takes at most 64 MiB of carried files; unpacked there.
  mkdir -p .dev
  cp "$DIR/release/tp-allreduce" .dev/ && strip .dev/tp-allreduce
  for pair in "$DIR/$TARGET/release/examples/candle_tp:candle_tp" "$suite:suite-candle"; do
    tmp=$(mktemp); cp "${pair%%:*}" "$tmp"; strip "$tmp"
    xz -T0 -6 -c "$tmp" > ".dev/${pair##*:}.xz"; rm -f "$tmp" ".dev/${pair##*:}"
  done
  ls -la .dev/tp-allreduce .dev/candle_tp.xz .dev/suite-candle.xz
  exit 0
fi
B=${TP_ALLREDUCE_BIN:-.dev/tp-allreduce}
OUT=${OUT:-results/candle}
mkdir -p "$OUT"
# The binaries as built by --build (xz) or copied plainly.
unpack() {
  if [ -x ".dev/$1" ]; then echo ".dev/$1"
  elif [ -f ".dev/$1.xz" ]; then
    local dir; dir=$(mktemp -d /tmp/candle-gpu.XXXXXX)
    xz -dc ".dev/$1.xz" > "$dir/$1" && chmod +x "$dir/$1" && echo "$dir/$1"
  fi
}
EXAMPLE=${CANDLE_TP_BIN:-$(unpack candle_tp)}
SUITE=${CANDLE_SUITE_BIN:-$(unpack suite-candle)}
[ -n "$EXAMPLE" ] || { echo "error: no .dev/candle_tp or .dev/candle_tp.xz (bash benches/gpu/candle-gpu.sh --build)" >&2; exit 1; }
LOG=$OUT/log.txt
: > "$LOG"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_DEVICE_MAX_CONNECTIONS=8 TP_ALLREDUCE_TIMEOUT_MS=5000

# Every folder that holds one of the libraries, PyTorch's wheels first.
lib_dirs=$(python3 - <<'PY' 2>/dev/null
import glob, os, site, sys
roots = [p for p in sys.path if p.endswith("-packages")] + site.getsitepackages()
wanted = ("libnccl.so", "libcublas.so", "libcublasLt.so", "libcurand.so", "libnvrtc.so", "libcudart.so")
dirs = []
for root in dict.fromkeys(roots):
    for lib in glob.glob(os.path.join(root, "nvidia", "**", "lib*.so*"), recursive=True):
        if os.path.basename(lib).startswith(wanted):
            d = os.path.dirname(lib)
            if d not in dirs:
                dirs.append(d)
for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"):
    if os.path.isdir(d) and d not in dirs:
        dirs.append(d)
print(":".join(dirs))
PY
)
export LD_LIBRARY_PATH="${lib_dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" | tee -a "$LOG"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"

missing=$(ldd "$EXAMPLE" 2>&1 | grep 'not found')
if [ -n "$missing" ]; then
  echo "error: $EXAMPLE cannot find these libraries (install PyTorch's NVIDIA wheels or the CUDA 13 toolkit):" | tee -a "$LOG"
  echo "$missing" | tee -a "$LOG"
  exit 1
fi
ldd "$EXAMPLE" | grep -E 'libcuda|nccl|cublas|curand|nvrtc|cudart' >> "$LOG"

status=0
run() { echo "=== $*" | tee -a "$LOG"; timeout 560 "$@" 2>&1 | tee -a "$LOG" | tail -40; local rc=${PIPESTATUS[0]}; echo "exit $rc" | tee -a "$LOG"; [ "$rc" -eq 0 ] || status=1; }
# The example: one process per GPU through the launcher (2 GPUs needed: the
# NCCL op it is compared with refuses two ranks on one GPU). On fewer, it
# is not run, the log says so and the exit status is 2, never 0.
if [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -ge 2 ]; then
  run "$B" launch -n 2 --gpus 0,1 --timeout 500 -- "$EXAMPLE"
else
  echo "=== example NOT run: fewer than 2 GPUs" | tee -a "$LOG"; status=2
fi
# The suite's candle GPU tests, when brought along (one process, GPU 0).
if [ -n "$SUITE" ] && [ -x "$SUITE" ]; then
  TP_ALLREDUCE_REQUIRE_GPU=1 run "$SUITE" candle --test-threads=1
fi
echo "done: $OUT (exit $status)"
exit $status
