"""Runs a scenario of `_scenarios` in one spawned process per rank (rank r
on GPU r % GPUs when there are GPUs), each with a gloo process group, and
collects what every rank recorded (and how its process exited). Stdlib only at import: PyTorch is
imported in the children after their environment (e.g.
PYTORCH_CUDA_ALLOC_CONF) is in place."""

import json
import multiprocessing
import os
import tempfile
import time
import traceback
from datetime import timedelta


def _entry(rank, world, init_file, scenario, out_dir, env):
    os.environ.update(env)
    result = {"rank": rank, "checks": {}, "facts": {}}
    try:
        import _scenarios
        import torch
        import torch.distributed as dist

        if torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=90)
        )
        try:
            getattr(_scenarios, scenario)(rank, world, result)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 (reported to the parent)
        result["fatal"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def run(world, scenario, env, timeout_s=240, may_die=()):
    """Results of every rank (a list of dicts with "checks", "facts",
    "exitcode" and, if the scenario crashed, "fatal"). Raises on timeout or
    on a rank that died without a result, unless it is in `may_die` (a
    scenario that ends a rank's process on purpose): then its entry is
    {"rank": r, "died": exit code}."""
    out_dir = tempfile.mkdtemp(prefix="tpar-test-")
    init_file = os.path.join(out_dir, "pg-init")
    ctx = multiprocessing.get_context("spawn")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # spawned children inherit it from the start
    try:
        procs = [
            ctx.Process(target=_entry, args=(r, world, init_file, scenario, out_dir, env), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    if hung:
        raise TimeoutError(f"scenario {scenario}: ranks {hung} still running after {timeout_s} s (killed)")
    results = []
    for r, p in enumerate(procs):
        path = os.path.join(out_dir, f"rank{r}.json")
        if not os.path.exists(path):
            if r in may_die:
                results.append({"rank": r, "died": p.exitcode})
                continue
            raise RuntimeError(f"scenario {scenario}: rank {r} died (exit code {p.exitcode}) without a result")
        with open(path) as f:
            results.append(json.load(f))
        results[-1]["exitcode"] = p.exitcode
    return results
