#!/usr/bin/env python3
"""FlashInfer's PCIe-IPC allreduce and NCCL on the GPUs of one host, timed the
way `tp-allreduce bench` times ours (one process per GPU, CUDA-graph replay,
median per allreduce, slowest rank): the peer column of
benches/gpu/vs-peers.sh.

FlashInfer runs from its published pip package, through its public API:
`flashinfer.comm.PcieIpcAllReduceWorkspace` (one workspace per message size,
sized to it, as FlashInfer's docstring advises), `ws.launch_config(x)` (the
package's untuned seed choice) and `flashinfer.comm.pcie_ipc_tuning.
candidate_tactics` (the grid the package's own `tune()` searches).

Columns (bf16, in microseconds per allreduce):
  nccl     torch.distributed.all_reduce, in place
  fi_seed  ws.all_reduce(x, out=y) with the seed launch configuration
  fi_best  the fastest candidate configuration of a sweep: every candidate is
           checked against the exact sum first, timed briefly on every rank,
           the slowest rank's time taken, and the winner timed again at full
           length

Inputs are small integers (zeros included), so the bf16 sums are exact and
every backend is checked for equality with the reference before it is timed.

What it needs on the GPU machine:
  * PyTorch with CUDA and NCCL;
  * FlashInfer's package and its dependencies, from PyPI:
      pip install flashinfer-python==0.7.2.post1
    (a 62 MB wheel; its dependencies include apache-tvm-ffi, nvidia-cutlass-dsl,
    nccl4py, cuda-tile and nvidia-cudnn-frontend, which `import flashinfer`
    loads). For a machine without network, `pip download` them elsewhere
    and `pip install --no-index --find-links DIR flashinfer-python`;
  * nvcc: FlashInfer compiles its pcie_ipc module with its JIT on first use
    (into its cache directory).

Usage, from the repository root:
  python3 benches/gpu/flashinfer_peer.py [--world-size 2] [--sizes 4K,16K,...]
      [--backends nccl,fi_seed,fi_best] [--json PATH]
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time

DEFAULT_SIZES = "4K,16K,42K,64K,256K,1M,8M"
BACKENDS = ("nccl", "fi_seed", "fi_best")
ELEM = 2  # bf16


def parse_size(token):
    token = token.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(token[-1:], 1)
    digits = token[:-1] if scale > 1 else token
    n = int(digits) * scale
    if n % 16:
        raise argparse.ArgumentTypeError(f"{token}: sizes must be multiples of 16 bytes")
    return n


def label(nbytes):
    return f"{nbytes >> 20}M" if nbytes >= 1 << 20 and nbytes % (1 << 20) == 0 else f"{nbytes >> 10}K"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_input(torch, numel, rank, device):
    # Values in -3..3 (zeros included): sums over 8 ranks stay exact in bf16.
    v = (torch.arange(numel, device=device, dtype=torch.int64) * 7 + rank * 3) % 7 - 3
    return v.to(torch.bfloat16)


def reference(torch, numel, world, device):
    return sum(make_input(torch, numel, r, device).float() for r in range(world)).to(torch.bfloat16)


def graph_time(torch, dist, fn, inner, replays):
    """Median microseconds per call of `fn`, `inner` calls captured in one
    CUDA graph and the graph replayed `replays` times; the slowest rank's."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / inner)
    del graph
    slowest = torch.tensor([statistics.median(times)], device="cuda", dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def all_ranks_ok(torch, dist, ok):
    flag = torch.tensor([1 if ok else 0], device="cuda", dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def worker(rank, world, port, args, queue):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=device)
    results, sweep = [], []

    def put(**row):
        if rank == 0:
            results.append(row)
            print(json.dumps(row), flush=True)

    for nbytes in args.sizes:
        numel = nbytes // ELEM
        x = make_input(torch, numel, rank, device)
        want = reference(torch, numel, world, device)
        y = torch.empty_like(x)
        if "nccl" in args.backends:
            y.copy_(x)
            dist.all_reduce(y)
            if not all_ranks_ok(torch, dist, torch.equal(y, want)):
                put(backend="nccl", size_bytes=nbytes, error="wrong sum")
            else:
                us = graph_time(torch, dist, lambda: dist.all_reduce(y), args.inner, args.replays)
                put(backend="nccl", size_bytes=nbytes, median_us=us)
        if "fi_seed" in args.backends or "fi_best" in args.backends:
            fi_size(torch, dist, rank, world, x, y, want, nbytes, args, put, sweep)
    dist.destroy_process_group()
    if rank == 0:
        queue.put({"results": results, "fi_sweep": sweep})


def fi_size(torch, dist, rank, world, x, y, want, nbytes, args, put, sweep):
    from flashinfer.comm import PcieIpcAllReduceWorkspace
    from flashinfer.comm.pcie_ipc_tuning import candidate_tactics, tactic_to_config

    numel = x.numel()
    ws = PcieIpcAllReduceWorkspace(group=dist.group.WORLD, max_numel=numel, dtype=torch.bfloat16)
    try:
        seed = ws.launch_config(x)
        if seed is None:
            for backend in ("fi_seed", "fi_best"):
                if backend in args.backends:
                    put(backend=backend, size_bytes=nbytes, error="shape not supported by the workspace")
            return

        def run(config):
            return lambda: ws.all_reduce(x, out=y, config=config)

        def checked(config):
            y.zero_()
            run(config)()
            torch.cuda.synchronize()
            return all_ranks_ok(torch, dist, torch.equal(y, want))

        if "fi_seed" in args.backends:
            if checked(seed):
                us = graph_time(torch, dist, run(seed), args.inner, args.replays)
                put(backend="fi_seed", size_bytes=nbytes, median_us=us, config=str(seed))
            else:
                put(backend="fi_seed", size_bytes=nbytes, error="wrong sum", config=str(seed))
        if "fi_best" in args.backends:
            tactics = candidate_tactics(
                world,
                ws.max_blocks,
                numel=numel,
                elem_size=ELEM,
                profile=ws.profile,
                memop_supported=ws.memop_supported,
            )
            best = None
            for tactic in tactics:
                config = tactic_to_config(tactic)
                if not checked(config):
                    sweep.append({"size_bytes": nbytes, "tactic": list(tactic), "error": "wrong sum"})
                    continue
                us = graph_time(torch, dist, run(config), args.sweep_inner, args.sweep_replays)
                sweep.append({"size_bytes": nbytes, "tactic": list(tactic), "median_us": us})
                if best is None or us < best[0]:
                    best = (us, config)
            if best is None:
                put(backend="fi_best", size_bytes=nbytes, error="no candidate gave the right sum")
            else:
                us = graph_time(torch, dist, run(best[1]), args.inner, args.replays)
                put(backend="fi_best", size_bytes=nbytes, median_us=us, config=str(best[1]), candidates=len(tactics))
    finally:
        torch.cuda.synchronize()
        ws.destroy()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="GPUs 0..N-1, one process each (2, 4 or 8)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes in bytes (default {DEFAULT_SIZES})")
    p.add_argument("--backends", default=",".join(BACKENDS), help="any of " + ",".join(BACKENDS))
    p.add_argument("--inner", type=int, default=100, help="allreduces captured in one graph")
    p.add_argument("--replays", type=int, default=50, help="timed graph replays")
    p.add_argument("--sweep-inner", type=int, default=20)
    p.add_argument("--sweep-replays", type=int, default=10)
    p.add_argument("--json", help="write the results here (default $OUT/peer_bench.json when $OUT is set)")
    args = p.parse_args(argv)
    try:
        args.sizes = [parse_size(t) for t in args.sizes.split(",") if t.strip()]
    except (ValueError, argparse.ArgumentTypeError) as e:
        p.error(f"--sizes: {e}")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(args.backends) - set(BACKENDS))
    if unknown:
        p.error(f"unknown backends {unknown}; known: {', '.join(BACKENDS)}")
    if args.world_size not in (2, 4, 8):
        p.error("--world-size: FlashInfer's PCIe-IPC allreduce runs on 2, 4 or 8 ranks")
    out = args.json or (os.path.join(os.environ["OUT"], "peer_bench.json") if os.environ.get("OUT") else None)

    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < args.world_size:
        print(f"flashinfer_peer.py: {args.world_size} GPUs needed, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda, "world_size": args.world_size}
    meta["gpus"] = [torch.cuda.get_device_name(i) for i in range(args.world_size)]
    if any(b.startswith("fi_") for b in args.backends):
        import flashinfer

        meta["flashinfer"] = getattr(flashinfer, "__version__", "unknown")
    started = time.time()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(worker, args=(args.world_size, free_port(), args, queue), nprocs=args.world_size,
                       join=True, start_method="spawn")
    report = dict(meta, **queue.get(), seconds=round(time.time() - started, 1))

    rows = {(r["backend"], r["size_bytes"]): r for r in report["results"]}
    print("\nmedian us per allreduce, bf16, graph replay, slowest rank "
          f"({args.world_size} x {meta['gpus'][0]}, flashinfer {meta.get('flashinfer', '-')})")
    print(f"{'size':>6} " + " ".join(f"{b:>9}" for b in args.backends))
    for nbytes in args.sizes:
        cells = []
        for b in args.backends:
            r = rows.get((b, nbytes), {})
            cells.append(f"{r['median_us']:9.2f}" if "median_us" in r else f"{'error' if r else '-':>9}")
        print(f"{label(nbytes):>6} " + " ".join(cells))
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
