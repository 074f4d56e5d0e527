# Shared by the GPU-machine scripts (benches/gpu/vs-peers.sh, gpu-suite.sh, fused.sh):
# bounded steps with their logs under $W, and the environment every
# command there needs. Source it after setting OUT, BUDGET and W.
#
#   step NAME LIMIT CMD...   runs CMD, output in $W/NAME.log, killed with
#                            its whole process tree after LIMIT seconds or
#                            when the budget is spent; records
#                            "NAME EXIT SECONDS" in $W/steps.txt

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
LOG=$W/log.txt
START=$SECONDS
# cudarc loads libnccl.so; the NCCL wheel ships libnccl.so.2.
if NCCL_DIR=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null); then
  mkdir -p /tmp/nccl && ln -sf "$NCCL_DIR/libnccl.so.2" /tmp/nccl/libnccl.so && export LD_LIBRARY_PATH=/tmp/nccl:${LD_LIBRARY_PATH:-}
fi

# Kills process `$1` and everything it started, by process id.
kill_tree() {
  local c
  for c in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$c"; done
  kill -KILL "$1" 2>/dev/null
}

step() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 25 ]; then
    echo "=== $name: skipped (out of time)" | tee -a "$LOG"; echo "$name skipped 0" >> "$W/steps.txt"; return
  fi
  local t=$((limit < left ? limit : left)) s=$SECONDS
  echo "=== $name (limit ${t}s): $*" | tee -a "$LOG"
  "$@" > "$W/$name.log" 2>&1 &
  local pid=$!
  ( sleep "$t"; echo "(killed after ${t}s)" >> "$W/$name.log"; kill_tree "$pid" ) &
  local dog=$!
  wait "$pid"; local rc=$?
  kill_tree "$dog"; wait "$dog" 2>/dev/null
  grep -vE '^\s*\[[0-9]+/|^\s*$' "$W/$name.log" | tail -n 30 | tee -a "$LOG"
  echo "=== $name: exit $rc after $((SECONDS - s)) s" | tee -a "$LOG"
  echo "$name $rc $((SECONDS - s))" >> "$W/steps.txt"
}

# MPS for steps whose processes share a GPU; `mps_stop` after them.
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d >> "$LOG" 2>&1
}
mps_stop() {
  echo quit | nvidia-cuda-mps-control >> "$LOG" 2>&1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
