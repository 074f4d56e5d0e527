"""Shared by the engine checks (runs inside each rank process).

Every check records PASS/FAIL with a detail instead of raising, after all of
its collective calls, so one rank's failure never leaves the other waiting.
Inputs are fresh random values (os.urandom seeds); the float64 reference is
the sum of every rank's input, gathered over the gloo world group; outputs
are poisoned with NaN before each call or replay; every output is also
compared bitwise across ranks.
"""

import json
import os
import time
import traceback

import torch
import torch.distributed as dist

TOL = {torch.float32: (2e-6, 1e-6), torch.float16: (2**-10, 1e-5), torch.bfloat16: (2**-8, 1e-5)}
NAN = float("nan")


class Recorder:
    def __init__(self, engine, rank, out_dir):
        self.engine, self.rank, self.out_dir = engine, rank, out_dir
        self.checks = {}
        self.facts = {}
        self.calls = 0  # outputs checked against the reference

    def run(self, name, fn):
        t = time.monotonic()
        try:
            detail = fn()
            self.checks[name] = {"ok": True, "detail": "" if detail is None else str(detail)}
        except Exception:
            self.checks[name] = {"ok": False, "detail": traceback.format_exc()}
        self.checks[name]["seconds"] = round(time.monotonic() - t, 2)
        status = "PASS" if self.checks[name]["ok"] else "FAIL"
        print(f"[{self.engine} rank {self.rank}] {status} {name} ({self.checks[name]['seconds']} s)", flush=True)

    def save(self, fatal=None):
        result = {"rank": self.rank, "checks": self.checks, "facts": self.facts, "calls": self.calls}
        if fatal:
            result["fatal"] = fatal
        with open(os.path.join(self.out_dir, f"{self.engine}-rank{self.rank}.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)


def fresh(shape, dtype, device):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") % 2**63)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).to(dtype).to(device)


def everyone(t, group=None):
    """Every rank's tensor (CPU float64 copies), over gloo."""
    world = dist.get_world_size(group)
    mine = t.detach().to("cpu", torch.float64).contiguous()
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return out


def reference(t, group=None):
    return sum(everyone(t, group))


def mismatch(out, ref, dtype, what, scale=None):
    """What is wrong with ``out`` against the f64 ``ref`` (None if nothing):
    NaN left from the poison, or an element beyond one rounding of the sum."""
    got = out.detach().to("cpu", torch.float64).reshape(ref.shape)
    if torch.isnan(got).any():
        return f"{what}: NaN in the output (poison not overwritten)"
    rel, absolute = TOL[dtype]
    bound = rel * (ref.abs() if scale is None else scale) + absolute
    bad = (got - ref).abs() > bound
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        return f"{what}: {int(bad.sum())} of {ref.numel()} off, first at {i}: got {got[i]}, want {ref[i]}"
    return None


def bitwise_across_ranks(out, what, group=None):
    """None if every rank holds the same bits in ``out``."""
    raw = out.detach().contiguous().view(torch.uint8).to("cpu")
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(raw) for _ in range(world)]
    dist.all_gather(gathered, raw, group=group)
    bad = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
    return f"{what}: ranks {bad} differ bitwise from rank 0" if bad else None


def raise_if(problems):
    problems = [p for p in problems if p]
    if problems:
        raise AssertionError("\n".join(problems[:12]) + (f"\n... {len(problems) - 12} more" if len(problems) > 12 else ""))


class CallCounter:
    """Counts the calls that reach tp-allreduce's communicator (wraps the
    instance's methods), so a check can tell that the engine's call really
    went through tp-allreduce."""

    def __init__(self, comm):
        self.counts = {}
        for name in ("all_reduce", "all_reduce_add_rms_norm", "all_gather", "reduce_scatter"):
            fn = getattr(comm, name, None)
            if fn is not None:
                setattr(comm, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def counted(*a, **k):
            self.counts[name] = self.counts.get(name, 0) + 1
            return fn(*a, **k)

        return counted

    def get(self, name):
        return self.counts.get(name, 0)


def stubs_loaded():
    """The explicit stub modules imported in this process."""
    import sys

    names = [n for n, m in sys.modules.items() if m is not None and getattr(m, "__tp_allreduce_stub__", False)]
    return sorted(names)
