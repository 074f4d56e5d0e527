"""Torch-free stand-ins for the adapter tests: a process group whose ranks
are threads, tensors that are lists of floats, a communicator that sums
them across the threads (and can capture its calls into a graph replayed
later, as CUDA-graph capture does), and the runtime object the adapters
take."""

import contextlib
import threading

ELEMENT_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4}


class FakeTensor:
    def __init__(self, values, dtype="bfloat16", device="cuda:0", contiguous=True):
        self.values = list(values)
        self.dtype = dtype
        self.device = device
        self.contiguous = contiguous

    @property
    def nbytes(self):
        return len(self.values) * ELEMENT_SIZE[self.dtype]


class FakeGroup:
    """An in-process group of `world` threads with a real collective gather."""

    def __init__(self, world):
        self.world = world
        self._barrier = threading.Barrier(world, timeout=10)
        self._slots = [None] * world

    def gather(self, rank, obj):
        self._slots[rank] = obj
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()
        return out


class FakeGraph:
    """Calls captured by ``FakeComm.graph()``: nothing is computed at
    capture; ``replay()`` runs them (collective), reading the inputs' values
    at replay time, like a CUDA graph. Replaying before the communicator
    registered the captured inputs raises, as the library does."""

    def __init__(self, comm):
        self.comm = comm
        self.ops = []

    def replay(self):
        if self.comm.unregistered:
            raise RuntimeError(f"replay before register_graph_buffers: {self.comm.unregistered} inputs unregistered")
        for op in self.ops:
            op()


class FakeComm:
    """Sums FakeTensors over the group's threads; records what it was asked.
    Inside ``graph()`` the calls are captured instead of run: their outputs
    stay NaN until the graph is replayed."""

    def __init__(self, group, rank, nccl_rule=None):
        self.group = group
        self.rank = rank
        self.calls = []
        # nccl_rule(what, nbytes, capturing) -> whether the plan is NCCL's
        # (what: "allreduce", "fused", "all-gather", "reduce-scatter"); None:
        # never. `plans` records every plan asked.
        self.nccl_rule = nccl_rule
        self.plans = []
        self.closed = False
        self.capturing = None  # the FakeGraph being captured
        self.unregistered = 0  # captured inputs not registered yet

    @contextlib.contextmanager
    def graph(self):
        """Stands for ``torch.cuda.graph(g)`` around the engine's forward."""
        g = FakeGraph(self)
        self.capturing = g
        try:
            yield g
        finally:
            self.capturing = None

    def _plan(self, what, nbytes, capturing):
        self.plans.append((what, nbytes, capturing))
        nccl = self.nccl_rule is not None and self.nccl_rule(what, nbytes, capturing)
        return "nccl" if nccl else "one-shot-push"

    def plan(self, nbytes, dtype, capturing=False):
        return (self._plan("allreduce", nbytes, capturing), "p2p", "fake")

    def plan_fused(self, rows, hidden, dtype, capturing=False):
        algorithm = self._plan("fused", rows * hidden * ELEMENT_SIZE[dtype], capturing)
        return (algorithm, "p2p", algorithm != "nccl", "fake")

    def plan_collective(self, collective, block_bytes, capturing=False):
        assert collective in ("all-gather", "reduce-scatter"), collective
        return (self._plan(collective, block_bytes, capturing), "fake")

    def all_reduce(self, t, out=None):
        assert not self.closed, "call on a closed communicator"
        self.calls.append(("all_reduce", len(t.values)))
        if out is None:
            out = FakeTensor([float("nan")] * len(t.values), t.dtype, t.device)

        def run():
            everyone = self.group.gather(self.rank, list(t.values))
            out.values = [sum(column) for column in zip(*everyone)]

        if self.capturing is None:
            run()
        else:
            out.values = [float("nan")] * len(t.values)
            self.capturing.ops.append(run)
            self.unregistered += 1
        return out

    def all_reduce_add_rms_norm(self, input, residual, weight, eps):  # noqa: A002
        assert not self.closed, "call on a closed communicator"
        assert self.capturing is None, "not captured by these tests"
        self.calls.append(("all_reduce_add_rms_norm", len(input.values)))
        everyone = self.group.gather(self.rank, input.values)
        residual.values = [sum(column) + r for column, r in zip(zip(*everyone), residual.values)]
        hidden = len(weight.values)
        normed = []
        for start in range(0, len(residual.values), hidden):
            row = residual.values[start : start + hidden]
            inv = (sum(v * v for v in row) / hidden + eps) ** -0.5
            normed += [v * inv * w for v, w in zip(row, weight.values)]
        return FakeTensor(normed, input.dtype, input.device), residual

    def register_graph_buffers(self):
        self.calls.append(("register_graph_buffers",))
        self.group.gather(self.rank, "register")  # collective, like the real one
        count, self.unregistered = self.unregistered, 0
        return count

    def close(self):
        self.calls.append(("close",))
        self.closed = True


class FakeRuntime:
    """What the adapter asks PyTorch for, answered by the fakes."""

    def __init__(self, rank, group, *, host="host-a", fail=None, nccl_rule=None):
        self.rank = rank
        self.group = group
        self.host = host
        self.fail = fail  # exception to raise when making the communicator
        self.nccl_rule = nccl_rule  # FakeComm's
        self.comm = None

    def rank_and_world(self, group):
        return self.rank, group.world

    def gather_object(self, group, obj):
        return group.gather(self.rank, obj)

    def hostname(self):
        return self.host

    def normalize_device(self, device):
        return device

    def make_communicator(self, group, device, capture_copy_bytes, size_independent=False):
        if self.fail is not None:
            raise self.fail
        self.comm = FakeComm(group, self.rank, self.nccl_rule)
        return self.comm

    def nbytes(self, t):
        return t.nbytes

    def dtype(self, t):
        return t.dtype

    def capturing(self):
        return self.comm is not None and self.comm.capturing is not None

    def compiling(self):
        return getattr(self, "tracing", False)

    def fused_shape(self, t, weight):
        return len(t.values) // len(weight.values), len(weight.values)

    def rows(self, t):
        return len(t.values)

    def rows_view(self, out, t, mul, div):
        return out

    def fused_ineligible(self, t, residual, weight):
        if residual.dtype != t.dtype or weight.dtype != t.dtype:
            return "dtypes differ"
        hidden = len(weight.values)
        if hidden == 0 or len(t.values) % hidden or len(residual.values) != len(t.values):
            return "shapes"
        return None

    def ineligible(self, t, device):
        if t.device != device:
            return "other device"
        if not t.contiguous:
            return "not contiguous"
        if t.dtype not in ("float32", "float16", "bfloat16"):
            return f"dtype {t.dtype}"
        return None


def run_ranks(world, body):
    """Runs body(rank) on `world` threads; returns the results in rank order
    and re-raises the first exception."""
    results = [None] * world
    errors = [None] * world

    def target(rank):
        try:
            results[rank] = body(rank)
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors[rank] = e

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a rank thread hung"
    for e in errors:
        if e is not None:
            raise e
    return results
