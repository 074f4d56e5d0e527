"""Starts the engine checks' rank processes (2 by default: one per GPU when
there are 2 GPUs, both on GPU 0 under MPS otherwise), bounds each run,
prints per-check PASS/FAIL, counts and versions; exit status 1 on any
failure, a crash, a timeout or a check that did not run.

    python -m engine_checks.run_checks OUT_DIR [--world 2] [--only sglang|vllm]
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

RUNS = [
    # (name, module, extra argv, environment)
    ("sglang", "engine_checks.sglang_check", [], {"TP_ALLREDUCE_SGLANG": "1"}),
    ("vllm-on", "engine_checks.vllm_check", ["on"], {"TP_ALLREDUCE_VLLM": "1"}),
    ("vllm-off", "engine_checks.vllm_check", ["off"], {"TP_ALLREDUCE_VLLM": "0"}),
    ("vllm-invariant", "engine_checks.vllm_check", ["invariant"], {"TP_ALLREDUCE_VLLM": "1", "VLLM_BATCH_INVARIANT": "1"}),
]
TIMEOUT_S = {"sglang": 150, "vllm-on": 90, "vllm-off": 90, "vllm-invariant": 90}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count():
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return len([line for line in out.stdout.splitlines() if line.startswith("GPU ")])


def run_one(name, module, extra, env_extra, world, out_dir, shared):
    port = free_port()
    env = dict(os.environ, **env_extra, PYTHONUNBUFFERED="1")
    if shared:
        env["VLLM_DISABLE_PYNCCL"] = "1"  # NCCL refuses two ranks on one GPU
    procs, logs = [], []
    for rank in range(world):
        log = open(os.path.join(out_dir, f"{name}-rank{rank}.log"), "w")
        logs.append(log)
        cmd = [sys.executable, "-m", module, str(rank), str(world), str(port), out_dir, *extra]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + TIMEOUT_S[name]
    timed_out = False
    for p in procs:
        try:
            p.wait(max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    for log in logs:
        log.close()
    results = []
    for rank in range(world):
        path = os.path.join(out_dir, f"{name}-rank{rank}.json")
        results.append(json.load(open(path)) if os.path.exists(path) else None)
    return results, timed_out, [p.returncode for p in procs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--only", choices=["sglang", "vllm"])
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    gpus = gpu_count()
    shared = gpus < args.world
    print(
        f"engine checks: {args.world} processes, {gpus} GPU(s): "
        + ("all ranks on GPU 0 under MPS; device groups on gloo (NCCL refuses two ranks on one GPU), no pynccl" if shared else "one GPU per process, NCCL device groups"),
        flush=True,
    )
    failed, summary = False, []
    for name, module, extra, env_extra in RUNS:
        if args.only and not name.startswith(args.only):
            continue
        t = time.monotonic()
        results, timed_out, codes = run_one(name, module, extra, env_extra, args.world, args.out_dir, shared)
        took = time.monotonic() - t
        names = sorted({c for r in results if r for c in r["checks"]})
        for check in names:
            oks = [bool(r and r["checks"].get(check, {}).get("ok")) for r in results]
            ok = all(oks)
            failed |= not ok
            print(f"{'PASS' if ok else 'FAIL'} {name}/{check}", flush=True)
            if not ok:
                for r in results:
                    if r and check in r["checks"] and not r["checks"][check]["ok"]:
                        print("    rank", r["rank"], r["checks"][check]["detail"].strip().replace("\n", "\n    "))
            else:
                detail = results[0]["checks"][check]["detail"]
                if detail:
                    print(f"    {detail}")
        for rank, r in enumerate(results):
            if r is None or r.get("fatal"):
                failed = True
                print(f"FAIL {name}: rank {rank} " + ("left no result" if r is None else "crashed:\n" + r["fatal"]))
        if timed_out:
            failed = True
            print(f"FAIL {name}: timed out after {TIMEOUT_S[name]} s (killed)")
        if any(c != 0 for c in codes):
            failed = True
            print(f"FAIL {name}: exit codes {codes} (logs: {name}-rank*.log)")
        facts = (results[0] or {}).get("facts", {})
        calls = sum((r or {}).get("calls", 0) for r in results)
        summary.append(f"{name}: {len(names)} checks, {calls} checked outputs over {args.world} ranks, {took:.0f} s; facts {json.dumps(facts, default=str)}")
    print("\n".join(summary))
    print("engine checks:", "FAILED" if failed else "all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
