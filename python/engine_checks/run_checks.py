"""Starts the engine checks' rank processes (2 by default: one per GPU when
there are enough GPUs, all on GPU 0 under MPS otherwise), bounds each run,
prints per-check PASS / FAIL / NOT RUN, counts and versions; exit status 1
on any failure, a crash, a timeout or a check that did not report.

    python -m engine_checks.run_checks OUT_DIR [--world 2] [--only sglang|vllm]
        [--python sglang=PATH] [--python vllm-0.33.0=PATH] [--python vllm-0.34.0=PATH] [--dry-run]

``--python VENV=PATH``: the interpreter of a venv (run-on-gpu.sh: one per
``carry/<venv>.install``; SGLang and vLLM pin different versions of some
packages, and each pinned vLLM version has its own). ``sglang`` gets
SGLang's run; every ``vllm`` or ``vllm-<version>`` venv gets the three vLLM
runs (``vllm-<version>-on``, ``-off``, ``-invariant``), and with a version
in its name the check fails unless that is the version the venv imports.
Without ``--python``: this interpreter, as ``sglang`` and ``vllm``.

``--dry-run`` (CPU, no GPU needed): for each run, first one process imports
what the run imports on the GPU machine (every module of the engine's
seeds file and the check's own imports) with CUDA and NVML stood in
(cpu_stand_ins.py) so the CUDA-gated imports happen, resolves vLLM's
platform and builds SGLang's ServerArgs; then the rank processes run the
engine's distributed setup on CPU over gloo (init_distributed_environment,
initialize_model_parallel, the groups' communicators, tp-allreduce's
adapter, which must report itself disabled on every rank: no GPU) and tear
it down. What needs a GPU is not run.

A rank that exits non-zero ends its run at once: the other ranks get
SIGUSR1 (a Python stack dump into their log), then SIGKILL.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

VLLM_MODES = [
    # (mode, environment)
    ("on", {"TP_ALLREDUCE_VLLM": "1"}),
    ("off", {"TP_ALLREDUCE_VLLM": "0"}),
    ("invariant", {"TP_ALLREDUCE_VLLM": "1", "VLLM_BATCH_INVARIANT": "1"}),
]
# The version a ``vllm-<version>`` venv must import (vllm_check's
# platform_resolution reads it).
EXPECT_VERSION = "ENGINE_CHECKS_EXPECT_VERSION"
# The run's name (its processes' JSON and logs: OUT_DIR/<run>-rank<r>.json).
RUN_NAME = "ENGINE_CHECKS_RUN"
# Seconds per run (imports ~20 s, setup, checks): SGLang and two vLLM
# versions, 120 + 2 x (75 + 60 + 60) = 510 s in all at most.
TIMEOUT_S = {"sglang": 120, "on": 75, "off": 60, "invariant": 60}


def runs(venvs):
    """[(name, venv, module, extra argv, environment, seconds)] for the
    venvs given (names, in order): SGLang's run for ``sglang``, the three
    vLLM runs for each ``vllm`` / ``vllm-<version>``."""
    out = []
    for venv in venvs:
        engine, _, version = venv.partition("-")
        if engine == "sglang":
            out.append(("sglang", venv, "engine_checks.sglang_check", [], {"TP_ALLREDUCE_SGLANG": "1"}, TIMEOUT_S["sglang"]))
        elif engine == "vllm":
            pin = {EXPECT_VERSION: version} if version else {}
            for mode, env in VLLM_MODES:
                out.append((f"{venv}-{mode}", venv, "engine_checks.vllm_check", [mode], dict(env, **pin), TIMEOUT_S[mode]))
        else:
            raise SystemExit(f"run_checks: no checks for a venv named {venv!r}")
    return out
DRY_TIMEOUT_S = 420  # per process group on this slow CPU: imports take longest
# Always: symmetric memory needs NVLink multicast, which the GPU machines keep
# off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1): vLLM's SymmMemCommunicator could
# only end disabled, after a 64 MiB rendezvous between the ranks.
ENV_ALWAYS = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
# Ranks sharing one GPU: NCCL refuses two ranks on one device (vLLM's pynccl
# off; SGLang's is off through the harness); SGLang's P2P probe of its own
# custom allreduce would spawn test processes for a GPU pair that does not
# exist (it then fails either way; skipped, SGLang asks the driver instead).
ENV_SHARED = {"VLLM_DISABLE_PYNCCL": "1", "SGLANG_SKIP_P2P_CHECK": "1"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len([line for line in out.stdout.splitlines() if line.startswith("GPU ")])


def _signal_group(p, sig):
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def supervise(procs, timeout_s, labels):
    """Waits for ``procs``; when one exits non-zero or the time is up, the
    others get SIGUSR1 (stack dump), then SIGKILL. Returns (timed_out,
    the label of the first process that failed, or None)."""
    deadline = time.monotonic() + timeout_s
    first_failed = None
    timed_out = False
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed or time.monotonic() > deadline:
            if failed:
                first_failed = labels[failed[0]]
            else:
                timed_out = True
            alive = [p for p in procs if p.poll() is None]
            for p in alive:
                _signal_group(p, signal.SIGUSR1)
            time.sleep(2)
            for p in alive:
                _signal_group(p, signal.SIGKILL)
            for p in alive:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass
            break
        time.sleep(0.2)
    return timed_out, first_failed


def start(cmd, env, log_path):
    log = open(log_path, "w")
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return p


def run_one(name, module, extra, env, python, world, out_dir, dry_run, timeout_s):
    """One run's processes: (per-process results, timed out, exit codes, first failure)."""
    jobs = []  # (label, json name, argv)
    if dry_run:
        engine = name.split("-")[0]
        mode = extra[0] if extra else "-"
        jobs.append(("imports", f"{name}-imports", [python, "-m", "engine_checks.dry_imports", engine, mode, out_dir, name]))
    port = free_port()
    for rank in range(world):
        argv = [python, "-m", module, str(rank), str(world), str(port), out_dir, *extra]
        jobs.append((f"rank {rank}", f"{name}-rank{rank}", argv + (["--dry-run"] if dry_run else [])))
    results, codes, timed_out, first_failed = {}, {}, False, None
    # The import phase runs alone first (its result says whether the ranks'
    # imports can work at all); then the ranks together.
    phases = [jobs[:1], jobs[1:]] if dry_run else [jobs]
    for phase in phases:
        procs = [start(argv, env, os.path.join(out_dir, f"{base}.log")) for _, base, argv in phase]
        limit = DRY_TIMEOUT_S if dry_run else timeout_s
        t_out, failed = supervise(procs, limit, [label for label, _, _ in phase])
        timed_out |= t_out
        first_failed = first_failed or failed
        for (label, base, _), p in zip(phase, procs):
            codes[label] = p.returncode
            path = os.path.join(out_dir, f"{base}.json")
            results[label] = json.load(open(path)) if os.path.exists(path) else None
        if t_out:
            break
    return results, timed_out, codes, first_failed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--only", choices=["sglang", "vllm"])
    ap.add_argument("--python", action="append", default=[], metavar="ENGINE=PATH")
    ap.add_argument("--dry-run", action="store_true", help="CPU: imports and distributed setup, no GPU work")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    pythons = {}
    for item in args.python:
        venv, path = item.split("=", 1)
        pythons[venv] = path
    if not pythons:
        pythons = {"sglang": sys.executable, "vllm": sys.executable}
    gpus = 0 if args.dry_run else gpu_count()
    shared = gpus < args.world
    if args.dry_run:
        print(f"engine checks (dry run, CPU): {args.world} processes, gloo, no GPU work", flush=True)
    elif gpus == 0:
        print("engine checks: no GPU found (nvidia-smi -L lists none)", flush=True)
        return 1
    else:
        print(
            f"engine checks: {args.world} processes, {gpus} GPU(s): "
            + (
                "all ranks on GPU 0 under MPS; device groups on gloo (NCCL refuses two ranks on one GPU), no pynccl"
                if shared
                else "one GPU per process, NCCL device groups"
            ),
            flush=True,
        )
    env_fixed = dict(ENV_ALWAYS, **(ENV_SHARED if shared else {}))
    print("environment set for every run: " + " ".join(f"{k}={v}" for k, v in sorted(env_fixed.items())), flush=True)
    failed, summary = False, []
    totals = {"PASS": 0, "FAIL": 0, "NOT RUN": 0}
    for name, venv, module, extra, env_extra, timeout_s in runs(list(pythons)):
        if args.only and venv.split("-")[0] != args.only:
            continue
        env = dict(os.environ, **env_fixed, **env_extra, PYTHONUNBUFFERED="1", **{RUN_NAME: name})
        t = time.monotonic()
        print(f"--- {name} ({pythons[venv]})", flush=True)
        results, timed_out, codes, first_failed = run_one(
            name, module, extra, env, pythons[venv], args.world, args.out_dir, args.dry_run, timeout_s
        )
        took = time.monotonic() - t
        names = []  # (phase, check): the dry run's import phase, or the ranks
        for label, r in results.items():
            phase = "ranks" if label.startswith("rank") else label
            for c in (r or {}).get("checks", {}):
                if (phase, c) not in names:
                    names.append((phase, c))
        for phase, check in names:
            labels = [label for label in results if (label.startswith("rank") if phase == "ranks" else label == phase)]
            entries = {label: (results[label] or {}).get("checks", {}).get(check) for label in labels}
            present = {label: e for label, e in entries.items() if e is not None}
            statuses = {e["status"] for e in present.values()}
            missing = [label for label in labels if label not in present]
            check = check if phase == "ranks" else f"{phase}/{check}"
            if "FAIL" in statuses or missing:
                status = "FAIL"
            elif statuses == {"PASS"}:
                status = "PASS"
            else:
                status = "NOT RUN"
            totals[status] += 1
            failed |= status == "FAIL"
            print(f"{status} {name}/{check}", flush=True)
            for label, e in present.items():
                if e["status"] != "PASS" and (status == "FAIL" or label == next(iter(present))):
                    print(f"    {label}: " + e["detail"].strip().replace("\n", "\n    "))
            for label in missing:
                print(f"    {label}: did not report this check")
            if status == "PASS":
                detail = next(iter(present.values()))["detail"]
                if detail:
                    print("    " + detail.replace("\n", "\n    "))
        for label, r in results.items():
            if r is None:
                failed = True
                totals["FAIL"] += 1
                print(f"FAIL {name}: {label} left no result (log: {name}-*.log)")
            elif r.get("fatal"):
                failed = True
                totals["FAIL"] += 1
                print(f"FAIL {name}: {label} crashed:\n    " + r["fatal"].strip().replace("\n", "\n    "))
            elif r.get("running"):
                print(f"    {name}: {label} was in '{r['running']}' when stopped")
        if timed_out:
            failed = True
            totals["FAIL"] += 1
            print(f"FAIL {name}: timed out after {DRY_TIMEOUT_S if args.dry_run else timeout_s} s (stack dumps in the logs)")
        if first_failed:
            print(f"    {name}: {first_failed} exited first with an error; the others were stopped")
        bad_codes = {label: c for label, c in codes.items() if c != 0}
        if bad_codes:
            failed = True
            print(f"FAIL {name}: exit codes {codes} (logs: {args.out_dir}/{name}-*.log)")
        first = results.get("rank 0") or next((r for r in results.values() if r), {})
        facts = dict(first.get("facts", {}))
        facts.pop("distributions", None)
        facts.pop("modules", None)
        calls = sum((r or {}).get("calls", 0) for r in results.values())
        summary.append(f"{name}: {len(names)} checks, {calls} checked outputs, {took:.0f} s; facts {json.dumps(facts, default=str)}")
    print("\n".join(summary))
    print(f"{totals['PASS']} passed, {totals['FAIL']} failed, {totals['NOT RUN']} not run")
    print("engine checks:", "FAILED" if failed else ("all passed" if not totals["NOT RUN"] else "no failure (some checks not run, listed above)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
