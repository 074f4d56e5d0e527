"""What the GPU's PCIe link to host memory does, measured with the copy
engines: the cost model's PCIe parameters that a machine without
GPU-to-GPU PCIe can still measure (docs/COST-MODEL.md, "PCIe parameters").

  * bandwidth of one copy stream, host -> device and device -> host, and
    both directions at once (two streams), pinned host memory, 64 KB-64 MB;
  * the time of one small copy inside a CUDA graph (a copy-engine step of
    the copy-engine ring), from graphs of 1 and of 64 dependent copies;
  * the same copies eagerly (per-copy launch cost).

Every figure is the median of `--repeats` timed replays (CUDA events), in
microseconds or GB/s (1e9 bytes/s). Prints a table and writes JSON.

    python3 benches/pcie_probe.py --out pcie.json
"""

import argparse
import json
import statistics
import sys

import torch


def timed(fn, repeats, inner):
    """Median microseconds of one of `inner` calls of `fn` over `repeats` samples."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) * 1000.0 / inner)
    return statistics.median(samples)


def graph_of(copies, stream):
    """A CUDA graph of the copies (callables issuing async copies), run in order."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for c in copies:  # warm-up outside capture
            c()
    stream.synchronize()
    with torch.cuda.graph(g, stream=stream):
        for c in copies:
            c()
    return g


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    props = torch.cuda.get_device_properties(dev)
    result = {"device": props.name, "torch": torch.__version__, "bandwidth": [], "small_copy": {}}
    stream = torch.cuda.Stream()
    side = torch.cuda.Stream()

    # Bandwidth: one stream per direction; both directions at once.
    for size in [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]:
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        host2 = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        devbuf = torch.empty(size, dtype=torch.uint8, device=dev)
        devbuf2 = torch.empty(size, dtype=torch.uint8, device=dev)
        inner = max(1, min(50, (256 << 20) // size))

        def h2d():
            devbuf.copy_(host, non_blocking=True)

        def d2h():
            host.copy_(devbuf, non_blocking=True)

        with torch.cuda.stream(stream):
            t_h2d = timed(h2d, args.repeats, inner)
            t_d2h = timed(d2h, args.repeats, inner)
        # Both directions: H2D on `stream`, D2H on `side`, joined per round.
        def both():
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            devbuf.copy_(host, non_blocking=True)
            with torch.cuda.stream(side):
                host2.copy_(devbuf2, non_blocking=True)
            cur.wait_stream(side)

        with torch.cuda.stream(stream):
            t_both = timed(both, args.repeats, inner)
        row = {
            "bytes": size,
            "h2d_gbps": size / t_h2d / 1e3,
            "d2h_gbps": size / t_d2h / 1e3,
            "duplex_gbps_each": size / t_both / 1e3,
        }
        result["bandwidth"].append(row)

    # Small copies: the fixed cost of one copy-engine operation.
    small = 16
    host = torch.empty(small, dtype=torch.uint8, pin_memory=True)
    devbuf = torch.empty(small, dtype=torch.uint8, device=dev)
    dev2 = torch.empty(small, dtype=torch.uint8, device=dev)
    for name, copy in [
        ("h2d", lambda: devbuf.copy_(host, non_blocking=True)),
        ("d2h", lambda: host.copy_(devbuf, non_blocking=True)),
        ("d2d", lambda: dev2.copy_(devbuf, non_blocking=True)),
    ]:
        per = {}
        for n in (1, 64):
            g = graph_of([copy] * n, stream)
            with torch.cuda.stream(stream):
                per[n] = timed(g.replay, args.repeats, 20)
        with torch.cuda.stream(stream):
            eager = timed(copy, args.repeats, 100)
        result["small_copy"][name] = {
            "graph_1_copy_us": per[1],
            "graph_64_copies_us": per[64],
            # Each further dependent copy node of a graph.
            "graph_step_us": (per[64] - per[1]) / 63.0,
            "eager_us": eager,
        }

    print(f"device: {result['device']} (torch {result['torch']})")
    print(f"{'bytes':>10} {'H2D GB/s':>10} {'D2H GB/s':>10} {'duplex GB/s each':>17}")
    for r in result["bandwidth"]:
        print(f"{r['bytes']:>10} {r['h2d_gbps']:>10.2f} {r['d2h_gbps']:>10.2f} {r['duplex_gbps_each']:>17.2f}")
    print(f"{'16 B copy':>10} {'graph, 1':>10} {'graph, 64':>10} {'per step':>10} {'eager':>8}  (us)")
    for name, s in result["small_copy"].items():
        print(
            f"{name:>10} {s['graph_1_copy_us']:>10.2f} {s['graph_64_copies_us']:>10.2f} "
            f"{s['graph_step_us']:>10.3f} {s['eager_us']:>8.2f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
