"""Shared by the engine checks (runs inside each rank process).

Every check records PASS/FAIL with a detail instead of raising, after all of
its collective calls, so one rank's failure never leaves the other waiting.
Inputs are fresh random values (os.urandom seeds); the float64 reference is
the sum of every rank's input, gathered over a gloo group (the engine's
world CPU group: ``GATHER_GROUP``; the default group is NCCL with one GPU
per process); outputs are poisoned with NaN before each call or replay;
every output is also compared bitwise across ranks.

A check that cannot run in this setting is recorded as NOT RUN with the
reason (never as a pass).
"""

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

TOL = {torch.float32: (2e-6, 1e-6), torch.float16: (2**-10, 1e-5), torch.bfloat16: (2**-8, 1e-5)}
NAN = float("nan")
# Every wait on the other rank (process-group creation, gloo collectives on
# the default group) gives up after this: a rank whose peer died fails
# within it instead of waiting for the run's timeout. The launcher also
# kills the survivors as soon as one rank exits non-zero.
PEER_TIMEOUT = timedelta(seconds=60)
GATHER_GROUP = None  # gloo group for the references (set by the check after setup)


class NotRun(Exception):
    """Raised by a check that cannot run here (the reason is reported; the
    check counts as not run, never as passed)."""


def rank_process_start(rank, world):
    """Common start of a rank process: stack dumps on SIGUSR1 (the launcher
    sends it before killing a rank that hangs) and on a fatal signal; the
    GPU this rank uses (rank % GPUs: ranks beyond the GPU count share one);
    returns (device index, GPUs, whether ranks share a GPU)."""
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    gpus = torch.cuda.device_count()
    if gpus == 0:
        return None, 0, True
    index = rank % gpus
    torch.cuda.set_device(index)
    return index, gpus, gpus < world


class Recorder:
    """Per-rank results, written to OUT_DIR/<engine>-rank<r>.json before and
    after every step (``running`` names the step in progress, so a rank
    killed in a hang still says where it was)."""

    def __init__(self, engine, rank, out_dir, label=None):
        self.engine, self.rank, self.out_dir = engine, rank, out_dir
        self.label = label or f"rank{rank}"
        self.checks = {}
        self.facts = {}
        self.calls = 0  # outputs checked against the reference
        self.running = None
        self.save()

    def run(self, name, fn):
        t = time.monotonic()
        self.running = name
        self.save()
        print(f"[{self.engine} {self.label}] ... {name}", flush=True)
        try:
            detail = fn()
            self.checks[name] = {"status": "PASS", "detail": "" if detail is None else str(detail)}
        except NotRun as e:
            self.checks[name] = {"status": "NOT RUN", "detail": str(e)}
        except Exception:
            self.checks[name] = {"status": "FAIL", "detail": traceback.format_exc()}
        self.checks[name]["ok"] = self.checks[name]["status"] == "PASS"
        self.checks[name]["seconds"] = round(time.monotonic() - t, 2)
        self.running = None
        self.save()
        print(f"[{self.engine} {self.label}] {self.checks[name]['status']} {name} ({self.checks[name]['seconds']} s)", flush=True)
        return self.checks[name]["ok"]

    def save(self, fatal=None):
        result = {"rank": self.rank, "checks": self.checks, "facts": self.facts, "calls": self.calls, "running": self.running}
        if fatal:
            result["fatal"] = fatal
        path = os.path.join(self.out_dir, f"{self.engine}-{self.label}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(path + ".tmp", path)

    def guard(self, main):
        """Runs ``main()``; an exception escaping it is saved as the rank's
        ``fatal`` and ends the process with status 1 (the launcher then
        stops the other ranks at once)."""
        try:
            main()
            self.running = None
            self.save()
        except BaseException:
            self.facts["modules"] = engine_modules()
            self.save(fatal=(f"in {self.running}: " if self.running else "") + traceback.format_exc())
            traceback.print_exc()
            sys.stdout.flush()
            os._exit(1)  # no interpreter teardown (a peer may be gone mid-collective)


def fresh(shape, dtype, device):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") % 2**63)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).to(dtype).to(device)


def everyone(t, group=None):
    """Every rank's tensor (CPU float64 copies), over gloo."""
    group = group if group is not None else GATHER_GROUP
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
    group = group if group is not None else GATHER_GROUP
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

    names = [n for n, m in list(sys.modules.items()) if m is not None and getattr(m, "__tp_allreduce_stub__", False) is True]
    return sorted(names)


def imported_distributions():
    """{distribution: version} of the installed packages whose modules this
    process imported (which carried and which image packages the path uses)."""
    import importlib.metadata as md

    top = {name.split(".")[0] for name in list(sys.modules)}
    mapping = md.packages_distributions()
    out = {}
    for name in sorted(top):
        for d in mapping.get(name, ()):
            try:
                out[d] = md.version(d)
            except md.PackageNotFoundError:
                pass
    return out


def engine_modules():
    """The SGLang / vLLM modules this process imported (what a trimmed
    engine wheel must hold: recorded by the dry run to keep the seeds
    files complete)."""
    return sorted(n for n in list(sys.modules) if n.split(".")[0] in ("sglang", "vllm"))
