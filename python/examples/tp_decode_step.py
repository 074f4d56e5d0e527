"""End-to-end check: one tensor-parallel decode step of a transformer-shaped
stack, captured in one CUDA graph, with tp-allreduce, torch.distributed
NCCL and torch symmetric memory as the allreduce, in the same run.

Each of the `--layers` layers has two blocks (attention- and MLP-shaped):

    h = h + allreduce( silu(rmsnorm(h) @ A_rank) @ B_rank )

with A_rank a column-parallel [hidden, inter] and B_rank a row-parallel
[inter, hidden] slice of random weights: 2 allreduces of tokens x hidden
bf16 per layer (61 layers x 2 x 42 KB by default, the verify pass of the
deployment that motivated the library). One process per GPU. The step is
run with the allocator's default configuration and with
`expandable_segments:True` (separate processes: PyTorch reads the setting at
start).

Prints a table (median graph-replay time per step over --iters replays,
timed with CUDA events; per-allreduce cost = (step - compute-only) / (2 x
layers); largest output difference from the NCCL step) and writes it as
JSON to --json, or to $OUT/tp_decode_step.json when OUT is set. Exits 1 if a
run failed or tp-allreduce's output differs from NCCL's by more than 1% of
the output's largest magnitude.

    python python/examples/tp_decode_step.py [--world 2] [--alloc both]
"""

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from datetime import timedelta

# Keep every baseline off NVLink SHARP / multicast (PCIe boxes have neither).
ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ALLOC_CONFS = {"default": None, "expandable": "expandable_segments:True"}
BACKENDS = ["compute-only", "torch-nccl", "tp-allreduce", "torch-symm-mem"]
MAX_RELATIVE_DIFF = 1e-2


# ---------------------------------------------------------------- one rank
def build_model(torch, args, rank, world, device):
    bf16 = torch.bfloat16
    gen = torch.Generator(device=device)
    blocks = []
    for layer in range(args.layers):
        for block in range(2):
            gen.manual_seed(1000 + (layer * 2 + block) * 64 + rank)  # this rank's weight slices
            a = torch.randn(args.hidden, args.inter, generator=gen, device=device, dtype=bf16) / math.sqrt(args.hidden)
            b = torch.randn(args.inter, args.hidden, generator=gen, device=device, dtype=bf16)
            b /= math.sqrt(args.inter * world)
            gen.manual_seed(7 + layer * 2 + block)  # norm weights: the same on every rank
            w = 1 + 0.1 * torch.randn(args.hidden, generator=gen, device=device, dtype=bf16)
            blocks.append((a, b, w))
    gen.manual_seed(3)
    final_w = 1 + 0.1 * torch.randn(args.hidden, generator=gen, device=device, dtype=bf16)
    x0 = torch.randn(args.tokens, args.hidden, generator=gen, device=device, dtype=bf16)
    return blocks, final_w, x0


def make_step(torch, blocks, final_w):
    silu = torch.nn.functional.silu

    def rmsnorm(h, w):
        f = h.float()
        return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * w

    def step(x, allreduce):
        h = x
        for a, b, w in blocks:
            h = h + allreduce(silu(rmsnorm(h, w) @ a) @ b)
        return rmsnorm(h, final_w)

    return step


def make_backends(torch, dist, args, device, gloo):
    """name -> (allreduce function, context for capture, facts) or a reason it is unavailable."""
    backends = {"compute-only": (lambda y: y, nullcontext, {})}

    def nccl(y):
        dist.all_reduce(y)
        return y

    backends["torch-nccl"] = (nccl, nullcontext, {"backend": "torch.distributed NCCL (in place)"})

    try:
        from tp_allreduce import pointer_is_ipc_exportable
        from tp_allreduce.torch import Communicator

        comm = Communicator.from_group(gloo, device)
        probe = torch.empty(args.tokens, args.hidden, dtype=torch.bfloat16, device=device)
        facts = {
            "transport": comm.core.transport,
            "plan_captured": list(comm.plan(probe.numel() * 2, torch.bfloat16, capturing=True)),
            "activations_ipc_exportable": pointer_is_ipc_exportable(probe.data_ptr()),
            "comm": comm,
        }
        backends["tp-allreduce"] = (comm.all_reduce, comm.capture, facts)
    except Exception as e:
        backends["tp-allreduce"] = f"{type(e).__name__}: {e}"

    try:
        import torch.distributed._symmetric_memory as symm_mem

        name = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(name)
        buf = symm_mem.empty((args.tokens, args.hidden), dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(buf, name)
        one_shot = torch.ops.symm_mem.one_shot_all_reduce

        def symm(y):
            buf.copy_(y)
            return one_shot(buf, "sum", name)

        backends["torch-symm-mem"] = (symm, nullcontext, {"op": "torch.ops.symm_mem.one_shot_all_reduce"})
    except Exception as e:
        backends["torch-symm-mem"] = f"{type(e).__name__}: {e}"
    return backends


def time_graph(torch, g, iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        g.replay()
    samples = []
    for _ in range(iters):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0)
    samples.sort()
    return {
        "median_us": statistics.median(samples),
        "p10_us": samples[len(samples) // 10],
        "p90_us": samples[(len(samples) * 9) // 10],
    }


def run_rank(rank, world, args, alloc):
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    gloo = dist.new_group(backend="gloo")
    blocks, final_w, x0 = build_model(torch, args, rank, world, device)
    step = make_step(torch, blocks, final_w)
    backends = make_backends(torch, dist, args, device, gloo)
    # Run a backend only where every rank could set it up.
    ready = [None] * world
    dist.all_gather_object(ready, {n: not isinstance(b, str) for n, b in backends.items()}, group=gloo)
    report = {"alloc": alloc, "world": world, "backends": {}}
    outputs = {}
    for name in BACKENDS:
        entry = backends[name]
        if not all(r[name] for r in ready):
            reason = entry if isinstance(entry, str) else "unavailable on another rank"
            report["backends"][name] = {"skipped": reason}
            continue
        allreduce, capture, facts = entry
        x = x0.clone()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up (eager): also initialises NCCL before capture
                step(x, allreduce)
        torch.cuda.current_stream(device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with capture():
            with torch.cuda.graph(g):
                out = step(x, allreduce)
        timing = time_graph(torch, g, args.iters)
        outputs[name] = out.float().clone()
        shown = {k: v for k, v in facts.items() if k != "comm"}
        if "comm" in facts:
            shown["captured_copies"] = facts["comm"].core.captured_copies
        report["backends"][name] = {**timing, **shown}
        del g
        torch.cuda.synchronize(device)
    ref = outputs.get("torch-nccl")
    for name, out in outputs.items():
        if ref is None or name == "compute-only":
            continue
        diff = (out - ref).abs()
        report["backends"][name].update(
            max_abs_diff_vs_nccl=float(diff.max()),
            max_rel_diff_vs_nccl=float(diff.max() / ref.abs().max()),
            bitwise_equal_to_nccl=bool(torch.equal(out, ref)),
            finite=bool(torch.isfinite(out).all()),
        )
    tp = backends["tp-allreduce"]
    if not isinstance(tp, str):
        tp[2]["comm"].close()
    report["gpu"] = torch.cuda.get_device_name(device)
    report["torch"] = torch.__version__
    return report


def worker(rank, world, init_file, args, alloc, out_dir):
    os.environ.update(ENV_DEFAULTS)
    if ALLOC_CONFS[alloc]:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONFS[alloc]
    else:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    result = {}
    try:
        import torch
        import torch.distributed as dist

        dist.init_process_group(
            "nccl",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
            device_id=torch.device("cuda", rank),
        )
        try:
            result = run_rank(rank, world, args, alloc)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 (reported by the parent)
        result = {"fatal": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------- launcher
def run_config(args, alloc):
    out_dir = tempfile.mkdtemp(prefix="tp-decode-")
    init_file = os.path.join(out_dir, "pg-init")
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=worker, args=(r, args.world, init_file, args, alloc, out_dir)) for r in range(args.world)
    ]
    env_before = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if ALLOC_CONFS[alloc]:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONFS[alloc]
    else:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    try:
        for p in procs:
            p.start()
    finally:
        if env_before is None:
            os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        else:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = env_before
    deadline = time.monotonic() + args.timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    if any(p.is_alive() for p in procs):
        for p in procs:
            p.kill()
        return {"alloc": alloc, "fatal": f"timed out after {args.timeout} s"}
    results = []
    for r in range(args.world):
        path = os.path.join(out_dir, f"rank{r}.json")
        if not os.path.exists(path):
            return {"alloc": alloc, "fatal": f"rank {r} died (exit code {procs[r].exitcode})"}
        with open(path) as f:
            results.append(json.load(f))
    for r, res in enumerate(results):
        if "fatal" in res:
            return {"alloc": alloc, "fatal": f"rank {r}:\n{res['fatal']}"}
    report = results[0]
    # The worst difference over ranks (every rank holds the full output).
    for name, b in report["backends"].items():
        for key in ("max_abs_diff_vs_nccl", "max_rel_diff_vs_nccl"):
            if key in b:
                b[key] = max(res["backends"][name][key] for res in results)
        if "bitwise_equal_to_nccl" in b:
            b["bitwise_equal_to_nccl"] = all(res["backends"][name]["bitwise_equal_to_nccl"] for res in results)
    return report


def table(reports, args):
    calls = 2 * args.layers
    lines = [
        f"tp_decode_step: {args.world} ranks, {args.layers} layers x 2 allreduces of {args.tokens}x{args.hidden} bf16 "
        f"({args.tokens * args.hidden * 2 // 1024} KB), inter {args.inter}/rank, median of {args.iters} graph replays",
        f"{'allocator':<11} {'backend':<15} {'step us':>9} {'p10-p90 us':>15} {'us/allreduce':>13} "
        f"{'max|diff| vs NCCL':>18} {'bitwise':>8}",
    ]
    for rep in reports:
        if "fatal" in rep:
            lines.append(f"{rep['alloc']:<11} FAILED: {rep['fatal'].strip().splitlines()[-1]}")
            continue
        base = rep["backends"].get("compute-only", {}).get("median_us")
        for name in BACKENDS:
            b = rep["backends"][name]
            if "skipped" in b:
                lines.append(f"{rep['alloc']:<11} {name:<15} skipped: {b['skipped'][:90]}")
                continue
            per_call = "-" if base is None or name == "compute-only" else f"{(b['median_us'] - base) / calls:.2f}"
            diff = "reference" if name == "torch-nccl" else f"{b.get('max_abs_diff_vs_nccl', float('nan')):.3g}"
            if name == "compute-only":
                diff = "-"
            bitwise = {True: "yes", False: "no"}.get(b.get("bitwise_equal_to_nccl"), "-")
            lines.append(
                f"{rep['alloc']:<11} {name:<15} {b['median_us']:>9.1f} {b['p10_us']:>7.1f}-{b['p90_us']:<7.1f} "
                f"{per_call:>13} {diff:>18} {bitwise:>8}"
            )
        tp = rep["backends"].get("tp-allreduce", {})
        if "plan_captured" in tp:
            lines.append(
                f"{'':<11} tp-allreduce: {tp['plan_captured'][0]} over {tp['transport']}, activations IPC-exportable: "
                f"{tp['activations_ipc_exportable']}, captured copies: {tp['captured_copies']}"
            )
    return "\n".join(lines)


def verdict(reports):
    problems = []
    for rep in reports:
        if "fatal" in rep:
            problems.append(f"{rep['alloc']}: run failed")
            continue
        tp = rep["backends"]["tp-allreduce"]
        if "skipped" in tp:
            problems.append(f"{rep['alloc']}: tp-allreduce unavailable: {tp['skipped']}")
        elif not tp.get("finite", False) or tp.get("max_rel_diff_vs_nccl", 1.0) > MAX_RELATIVE_DIFF:
            problems.append(f"{rep['alloc']}: tp-allreduce output differs from NCCL's: {tp}")
    return problems


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=0, help="ranks (default: visible GPUs, at most 8)")
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--tokens", type=int, default=3)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048, help="intermediate size per rank")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--alloc", choices=["both", *ALLOC_CONFS], default="both")
    p.add_argument("--timeout", type=int, default=240, help="seconds per allocator configuration")
    p.add_argument("--json", default=None, help="where to write the report (default: $OUT/tp_decode_step.json)")
    args = p.parse_args(argv)
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    if args.world == 0:
        import torch  # only to count GPUs; CUDA state here does not reach the spawned ranks

        args.world = min(torch.cuda.device_count(), 8)
    if args.world < 2:
        print(f"tp_decode_step: needs at least 2 GPUs, {args.world} visible", file=sys.stderr)
        return 2
    allocs = list(ALLOC_CONFS) if args.alloc == "both" else [args.alloc]
    reports = [run_config(args, a) for a in allocs]
    print(table(reports, args))
    for rep in reports:
        if "fatal" in rep:
            print(f"\n{rep['alloc']} failed:\n{rep['fatal']}", file=sys.stderr)
    problems = verdict(reports)
    path = args.json or (os.path.join(os.environ["OUT"], "tp_decode_step.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump({"args": vars(args), "reports": reports, "problems": problems}, f, indent=2)
        print(f"report: {path}")
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
