"""What each rank runs in the GPU tests (one process per GPU, a gloo world
group; see `_spawn`). Every check records ok/detail instead of raising,
and does all of its collective calls before asserting, so a wrong value on
one rank does not leave the other waiting.

Inputs are fresh random values from a seed rank 0 draws per run; every rank
can rebuild every rank's input, so the f64 reference needs no
communication. Outputs are poisoned with NaN before each call or replay.
"""

import gc
import itertools
import logging
import os
import random
import threading
import time
import traceback

import torch
import torch.distributed as dist
import tp_allreduce
from tp_allreduce import errors, pointer_is_ipc_exportable
from tp_allreduce.torch import Communicator

ALGORITHMS = ["auto", "one-shot-pull", "two-shot-pull", "one-shot-push", "two-shot-push"]
PULL = ("one-shot-pull", "two-shot-pull")
# (relative, absolute) error bounds: one rounding of an f32 sum to the dtype.
TOL = {torch.float32: (1e-6, 1e-6), torch.float16: (2**-10, 1e-5), torch.bfloat16: (2**-8, 1e-5)}
CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
NAN = float("nan")
_case = itertools.count()  # the same sequence on every rank (deterministic scenarios)


class Recorder:
    def __init__(self, result):
        self.checks = result["checks"]
        self.facts = result["facts"]

    def run(self, name, fn):
        try:
            detail = fn()
            self.checks[name] = {"ok": True, "detail": "" if detail is None else str(detail)}
        except Exception:
            self.checks[name] = {"ok": False, "detail": traceback.format_exc()}


def shared_seed(rank):
    box = [random.getrandbits(62) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rank_input(seed, case, rank, shape, dtype):
    g = torch.Generator().manual_seed((seed * 1_000_003 + case * 8191 + rank) % 2**63)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)


def reference(seed, case, world, shape, dtype):
    return sum(rank_input(seed, case, r, shape, dtype).double() for r in range(world))


def mismatch(out, ref, dtype, what):
    """A description of what is wrong with `out`, or None."""
    got = out.detach().double().cpu()
    if torch.isnan(got).any():
        return f"{what}: NaN in the output (poison not overwritten)"
    rel, absolute = TOL[dtype]
    bad = (got - ref).abs() > rel * ref.abs() + absolute
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        return f"{what}: {int(bad.sum())} of {ref.numel()} elements off, first at {i}: got {got[i]}, expected {ref[i]}"
    return None


def raise_if(problems):
    problems = [p for p in problems if p]
    if problems:
        raise AssertionError("\n".join(problems[:10]))


# ---------------------------------------------------------------- checks
def check_exportability(device, expandable):
    t = torch.empty(1 << 20, device=device)
    exportable = pointer_is_ipc_exportable(t.data_ptr())
    assert exportable == (not expandable), f"exportable={exportable} with expandable_segments={expandable}"
    return f"exportable={exportable}"


def check_eager(comm, seed, rank, world):
    problems = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for n in (1, 7, 1000, 21504, 1 << 20):
            case = next(_case)
            x = rank_input(seed, case, rank, (n,), dtype).to(comm.device)
            before = x.clone()
            out = torch.full_like(x, NAN)
            comm.all_reduce(x, out=out)
            fresh = comm.all_reduce(x)
            inplace = x.clone()
            comm.all_reduce_(inplace)
            comm.synchronize()
            ref = reference(seed, case, world, (n,), dtype)
            what = f"{dtype} n={n}"
            problems += [
                mismatch(out, ref, dtype, f"{what} out="),
                mismatch(fresh, ref, dtype, f"{what} new tensor"),
                mismatch(inplace, ref, dtype, f"{what} in place"),
                None if torch.equal(x, before) else f"{what}: the input changed",
            ]
    raise_if(problems)
    return "3 dtypes x 5 sizes x (out=, new, in place)"


def expected_copy(comm, t, in_place=False):
    """Whether a call captured on `t` goes through the capture copy."""
    algorithm = comm.core.plan(t.numel() * t.element_size(), CODE[t.dtype], True, in_place)[0]
    return algorithm in PULL and not pointer_is_ipc_exportable(t.data_ptr())


def check_graph(comm, seed, rank, world):
    device = comm.device
    specs = [((3, 7168), torch.bfloat16), ((3000,), torch.float16), ((4096,), torch.float32)]
    static = [torch.zeros(shape, dtype=dt, device=device) for shape, dt in specs]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up, as PyTorch recommends before capture
        for x in static:
            comm.all_reduce(x)
    torch.cuda.current_stream(device).wait_stream(side)
    copies_before = comm.core.captured_copies
    g = torch.cuda.CUDAGraph()
    with comm.capture():
        with torch.cuda.graph(g):
            outs = [comm.all_reduce(x) for x in static]
            doubled = outs[0] * 2
            chained = comm.all_reduce(doubled)
            inplace = static[2] * 1
            comm.all_reduce_(inplace)
    copies = comm.core.captured_copies - copies_before
    expected = sum(expected_copy(comm, t) for t in static) + expected_copy(comm, doubled)
    expected += expected_copy(comm, inplace, in_place=True)
    problems = [None if copies == expected else f"captured copies: {copies}, expected {expected}"]
    for replay in range(3):
        cases = [next(_case) for _ in specs]
        for x, (shape, dt), c in zip(static, specs, cases):
            x.copy_(rank_input(seed, c, rank, shape, dt))
        for t in outs + [chained, inplace]:
            t.fill_(NAN)
        g.replay()
        comm.synchronize()
        for i, ((shape, dt), c) in enumerate(zip(specs, cases)):
            problems.append(mismatch(outs[i], reference(seed, c, world, shape, dt), dt, f"replay {replay} call {i}"))
        problems.append(
            mismatch(chained, world * 2 * outs[0].double().cpu(), torch.bfloat16, f"replay {replay} chained")
        )
        problems.append(
            mismatch(inplace, reference(seed, cases[2], world, specs[2][0], specs[2][1]), torch.float32, "in place")
        )
    del g
    # Release everything, then capture again: registrations (the capture
    # copy's buffer included) must work after deregister_buffers().
    comm.deregister_buffers()
    g2 = torch.cuda.CUDAGraph()
    with comm.capture():
        with torch.cuda.graph(g2):
            again = comm.all_reduce(static[0])
    case = next(_case)
    static[0].copy_(rank_input(seed, case, rank, specs[0][0], specs[0][1]))
    again.fill_(NAN)
    g2.replay()
    comm.synchronize()
    problems.append(mismatch(again, reference(seed, case, world, *specs[0]), torch.bfloat16, "after re-registration"))
    raise_if(problems)
    exportable = pointer_is_ipc_exportable(static[0].data_ptr())
    return f"5 captured calls, 3 replays + 1 after deregister; exportable={exportable} captured_copies={copies}"


def fused_reference(seed, case, world, shape, dtype):
    """(residual, normed) in f64 of the fused call of `case`: the residual
    and weight are rank 1000's and 1001's inputs (the same on every rank)."""
    residual = rank_input(seed, case, 1000, shape, dtype).double() + reference(seed, case, world, shape, dtype)
    weight = rank_input(seed, case, 1001, shape[-1:], dtype).double()
    inv = (residual.pow(2).mean(dim=-1, keepdim=True) + 1e-6).rsqrt()
    return residual, residual * inv * weight


def fused_mismatch(got, ref, dtype, what, scale=1.0):
    """`mismatch` with the tolerance of a few roundings (sum, add, norm)."""
    rel, absolute = TOL[dtype]
    err = (got.detach().double().cpu() - ref).abs()
    if torch.isnan(err).any():
        return f"{what}: NaN in the output"
    bad = err > 4 * rel * (ref.abs() + scale) + absolute
    return f"{what}: {int(bad.sum())} of {ref.numel()} elements off" if bad.any() else None


def check_compiled(comm, seed, rank, world):
    """torch.compile(fullgraph=True) over a layer calling the four entry
    points (allreduce, fused epilogue, all-gather, reduce-scatter): the
    compiled layer's outputs equal the eager layer's, bit for bit (same
    kernels, same inputs), and the f64 reference of the allreduce."""
    device = comm.device
    torch._dynamo.reset()

    def layer(x, residual, weight):
        y = comm.all_reduce(x)
        normed, residual = comm.all_reduce_add_rms_norm(y * 0.5, residual, weight, 1e-6)
        gathered = comm.all_gather(normed)
        return y, normed, residual, comm.reduce_scatter(gathered + 1.0)

    compiled = torch.compile(layer, fullgraph=True)
    problems = []
    for shape in ((world * 2, 4096), (world, 7168)):
        case = next(_case)
        x = rank_input(seed, case, rank, shape, torch.bfloat16).to(device)
        residual = rank_input(seed, case, 1000, shape, torch.bfloat16).to(device)
        weight = rank_input(seed, case, 1001, shape[-1:], torch.bfloat16).to(device)
        eager = layer(x.clone(), residual.clone(), weight)
        got = compiled(x.clone(), residual.clone(), weight)
        comm.synchronize()
        for name, e, g in zip(("allreduce", "normed", "residual", "reduce_scatter"), eager, got):
            if e.shape != g.shape or not torch.equal(e, g):
                problems.append(f"{shape} {name}: compiled differs from eager")
        problems.append(mismatch(got[0], reference(seed, case, world, shape, torch.bfloat16), torch.bfloat16, f"{shape} compiled allreduce"))
    raise_if(problems)
    return "fullgraph compiled layer == eager layer (4 entry points), allreduce == f64 reference"


def check_fused(comm, seed, rank, world):
    """`all_reduce_add_rms_norm` eagerly (out of place and in place) and
    in a captured graph replayed with fresh inputs, against the f64
    reference; the input stays unchanged out of place."""
    device = comm.device
    problems = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for shape in ((1, 128), (3, 7168), (7, 4096)):
            case = next(_case)
            x = rank_input(seed, case, rank, shape, dtype).to(device)
            residual = rank_input(seed, case, 1000, shape, dtype).to(device)
            weight = rank_input(seed, case, 1001, shape[-1:], dtype).to(device)
            before = x.clone()
            in_place_res = residual.clone()
            normed, res = comm.all_reduce_add_rms_norm(x, residual, weight, 1e-6)
            x2 = x.clone()
            comm.all_reduce_add_rms_norm(x2, in_place_res, weight, 1e-6, out=x2)
            comm.synchronize()
            want_res, want_normed = fused_reference(seed, case, world, shape, dtype)
            what = f"{dtype} {shape}"
            problems += [
                fused_mismatch(res, want_res, dtype, f"{what} residual", world),
                fused_mismatch(normed, want_normed, dtype, f"{what} normed", 1.0),
                fused_mismatch(x2, want_normed, dtype, f"{what} normed in place", 1.0),
                None if torch.equal(x, before) else f"{what}: the input changed",
            ]
    shape, dt = (3, 7168), torch.bfloat16
    x, residual = torch.zeros(shape, dtype=dt, device=device), torch.zeros(shape, dtype=dt, device=device)
    weight = torch.zeros(shape[-1:], dtype=dt, device=device)
    comm.all_reduce_add_rms_norm(x, residual, weight, 1e-6)  # warm-up
    comm.synchronize()
    g = torch.cuda.CUDAGraph()
    with comm.capture():
        with torch.cuda.graph(g):
            normed, _ = comm.all_reduce_add_rms_norm(x, residual, weight, 1e-6)
    for replay in range(3):
        case = next(_case)
        x.copy_(rank_input(seed, case, rank, shape, dt))
        residual.copy_(rank_input(seed, case, 1000, shape, dt))
        weight.copy_(rank_input(seed, case, 1001, shape[-1:], dt))
        normed.fill_(NAN)
        g.replay()
        comm.synchronize()
        want_res, want_normed = fused_reference(seed, case, world, shape, dt)
        problems.append(fused_mismatch(residual, want_res, dt, f"replay {replay} residual", world))
        problems.append(fused_mismatch(normed, want_normed, dt, f"replay {replay} normed", 1.0))
    raise_if(problems)
    plan = comm.core.plan_fused(3, 7168, CODE[dt], True)
    return f"3 dtypes x 3 shapes (out=, in place), 3 graph replays; plan {plan}"


def check_bad_tensors(device, world):
    comm = Communicator.from_group(None, device)
    other = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
    x = torch.ones(64, device=device, dtype=torch.bfloat16)
    cases = [
        (errors.Unsupported, "int32", lambda: comm.all_reduce(torch.ones(64, device=device, dtype=torch.int32))),
        (errors.Unsupported, "float64", lambda: comm.all_reduce(torch.ones(64, device=device, dtype=torch.float64))),
        (errors.InvalidUsage, "is on", lambda: comm.all_reduce(torch.ones(64, device=other, dtype=torch.bfloat16))),
        (errors.InvalidUsage, "is on cpu", lambda: comm.all_reduce(torch.ones(64, dtype=torch.bfloat16))),
        (errors.InvalidUsage, "contiguous", lambda: comm.all_reduce(torch.ones(8, 8, device=device).t())),
        (
            errors.InvalidUsage,
            "must match",
            lambda: comm.all_reduce(x, out=torch.empty(63, device=device, dtype=x.dtype)),
        ),
        (errors.InvalidUsage, "must match", lambda: comm.all_reduce(x, out=torch.empty(64, device=device))),
    ]
    problems = []
    for cls, words, call in cases:
        try:
            call()
            problems.append(f"{words}: no error")
        except cls as e:
            if words not in str(e):
                problems.append(f"{words}: message was {e}")
    comm.close()
    try:
        comm.all_reduce(x)
        problems.append("a closed communicator accepted a call")
    except errors.InvalidUsage as e:
        if "closed" not in str(e):
            problems.append(f"closed: message was {e}")
    raise_if(problems)
    return f"{len(cases) + 1} bad calls raised"


def check_device_unchanged(rank, world):
    here = torch.device("cuda", rank)
    other = (rank + 1) % torch.cuda.device_count()
    problems = []

    def expect(where, want):
        now = torch.cuda.current_device()
        if now != want:
            problems.append(f"after {where}: current device {now}, expected {want}")

    torch.cuda.set_device(other)
    try:
        comm = Communicator.from_group(None, here)
        expect("from_group", other)
        x = torch.ones(4096, device=here, dtype=torch.bfloat16)
        y = comm.all_reduce(x)
        expect("all_reduce", other)
        comm.all_reduce_(x)
        expect("all_reduce_", other)
        comm.synchronize()
        expect("synchronize", other)
        with torch.cuda.device(rank):
            g = torch.cuda.CUDAGraph()
            with comm.capture():
                with torch.cuda.graph(g):
                    z = comm.all_reduce(y)
            expect("capture + register_graph_buffers (inside torch.cuda.device)", rank)
        expect("leaving torch.cuda.device", other)
        g.replay()
        comm.synchronize()
        expect("replay", other)
        for what, t, value in (("y", y, world), ("x", x, world), ("z", z, world * world)):
            if not torch.all(t == value):
                problems.append(f"{what}: wrong values {t[:4].tolist()}, expected {value}")
        comm.close()
        expect("close", other)
    finally:
        torch.cuda.set_device(rank)
    raise_if(problems)
    return f"current device stayed {other} while the communicator ran on {rank}"


def check_sglang_call_sequence(seed, rank, world):
    """SGLang's order of calls (GroupCoordinator + CudaGraphRunner): build on
    every rank, eager calls, capture() around warm-ups and graph captures on
    a side stream with a shared graph pool, registration on exit, replays,
    disabled toggling, close."""
    from tp_allreduce.integrations.sglang import TpAllreduceCustomAllreduce

    device = torch.device("cuda", rank)
    ca = TpAllreduceCustomAllreduce(group=dist.group.WORLD, device=device)
    assert not ca.disabled and not ca.original_disabled, ca.disabled_reason
    problems = []
    dt = torch.bfloat16

    case = next(_case)
    x = rank_input(seed, case, rank, (3, 7168), dt).to(device)
    if not ca.should_custom_ar(x):
        problems.append("should_custom_ar refused a 42 KB bf16 tensor")
    eager = ca.custom_all_reduce(x)
    problems.append(mismatch(eager, reference(seed, case, world, (3, 7168), dt), dt, "eager"))
    if ca.should_custom_ar(torch.empty(ca.max_size // 2, dtype=dt, device=device)):
        problems.append("should_custom_ar accepted max_size bytes")
    if ca.custom_all_reduce(torch.ones(16, dtype=torch.int32, device=device)) is not None:
        problems.append("custom_all_reduce took an int32 tensor")

    def forward(inp):
        h = ca.custom_all_reduce(inp)
        return ca.custom_all_reduce(h * 0.5)

    def expected_forward(c, shape):
        h = reference(seed, c, world, shape, dt)
        return world * 0.5 * h.to(dt).double()

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    with torch.cuda.stream(stream), ca.capture():
        for bs in (1, 3, 8):
            static = torch.zeros(bs, 7168, dtype=dt, device=device)
            for _ in range(2):  # SGLang warms up twice before capturing
                case = next(_case)
                static.copy_(rank_input(seed, case, rank, (bs, 7168), dt))
                warm = forward(static)
                stream.synchronize()
                problems.append(mismatch(warm, expected_forward(case, (bs, 7168)), dt, f"warm-up bs={bs}"))
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                out = forward(static)
            graphs[bs] = (g, static, out)
    for replay in range(2):
        for bs, (g, static, out) in graphs.items():
            case = next(_case)
            static.copy_(rank_input(seed, case, rank, (bs, 7168), dt))
            out.fill_(NAN)
            g.replay()
            torch.cuda.synchronize(device)
            problems.append(mismatch(out, expected_forward(case, (bs, 7168)), dt, f"replay {replay} bs={bs}"))
    ca.disabled = True  # SGLang's piecewise graph runner toggles it
    if ca.custom_all_reduce(x) is not None:
        problems.append("disabled adapter still reduced")
    ca.disabled = ca.original_disabled
    ca.close()
    if not ca.disabled or ca.custom_all_reduce(x) is not None:
        problems.append("closed adapter still active")
    raise_if(problems)
    return "eager, 3 batch sizes x (2 warm-ups + capture), 2 replays each, toggle, close"


# ---------------------------------------------------------------- scenarios
def suite(rank, world, result):
    rec = Recorder(result)
    device = torch.device("cuda", rank)
    seed = shared_seed(rank)
    expandable = "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    rec.facts.update(expandable_segments=expandable, torch=torch.__version__, gpu=torch.cuda.get_device_name(device))
    rec.run("exportability", lambda: check_exportability(device, expandable))
    rec.run("bad_tensors", lambda: check_bad_tensors(device, world))
    for algorithm in ALGORITHMS:
        comm = None

        def make(algorithm=algorithm):
            nonlocal comm
            comm = Communicator.from_group(None, device, algorithm=None if algorithm == "auto" else algorithm)
            plan = comm.core.plan(43008, CODE[torch.bfloat16], True, False)
            rec.facts[f"{algorithm}: plan of a captured 42 KB bf16 call"] = list(plan)
            return f"transport={comm.core.transport} notes={comm.core.notes}"

        rec.run(f"{algorithm}/init", make)
        if comm is None:
            continue
        rec.run(f"{algorithm}/eager", lambda comm=comm: check_eager(comm, seed, rank, world))
        rec.run(f"{algorithm}/graph", lambda comm=comm: check_graph(comm, seed, rank, world))
        rec.run(f"{algorithm}/fused", lambda comm=comm: check_fused(comm, seed, rank, world))
        if algorithm == "auto":
            rec.run("compiled", lambda comm=comm: check_compiled(comm, seed, rank, world))
        comm.close()
    rec.run("device_unchanged", lambda: check_device_unchanged(rank, world))
    rec.run("sglang_call_sequence", lambda: check_sglang_call_sequence(seed, rank, world))


def sglang_group_coordinator(rank, world, result):
    """SGLang's own GroupCoordinator (only where sglang imports; its
    constructor as of SGLang 0.5.23: ``use_mscclpp``, no NPU flag): it
    builds our adapter through the patched dispatcher."""
    rec = Recorder(result)

    def run():
        import sglang.srt.distributed.device_communicators.custom_all_reduce as car
        from sglang.srt.distributed.parallel_state import GroupCoordinator
        from tp_allreduce.integrations.sglang import TpAllreduceCustomAllreduce, patch

        assert patch(car)
        gc = GroupCoordinator(
            group_ranks=[list(range(world))],
            local_rank=rank,
            torch_distributed_backend="gloo",
            use_pynccl=False,
            use_mscclpp=False,
            use_custom_allreduce=True,
            use_torch_symm_mem_all_reduce=False,
            use_hpu_communicator=False,
            use_xpu_communicator=False,
            group_name="tp",
        )
        assert isinstance(gc.ca_comm, TpAllreduceCustomAllreduce) and not gc.ca_comm.disabled
        x = torch.full((3, 7168), float(rank + 1), dtype=torch.bfloat16, device=gc.device)
        y = gc.all_reduce(x)
        assert torch.all(y == sum(range(1, world + 1))), y[0, :4]
        with gc.graph_capture() as ctx:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=ctx.stream):
                z = gc.all_reduce(x)
        g.replay()
        torch.cuda.synchronize()
        assert torch.all(z == sum(range(1, world + 1))), z[0, :4]
        gc.ca_comm.close()
        return "GroupCoordinator.all_reduce eager and in a captured graph"

    rec.run("sglang_group_coordinator", run)


def cpu_group_paths(rank, world, result):
    """The process-group plumbing, which needs no GPU: the adapters'
    gather under inference mode (where all_gather_object fails on gloo),
    from_group's id broadcast reaching the core, and the SGLang adapter
    disabling itself on every rank when the communicator cannot start."""
    rec = Recorder(result)

    def gather():
        from tp_allreduce.integrations._adapter import TorchRuntime

        with torch.inference_mode():
            got = TorchRuntime().gather_object(dist.group.WORLD, {"rank": rank})
        assert got == [{"rank": r} for r in range(world)], got

    def from_group_without_driver():
        try:
            Communicator.from_group(None, torch.device("cuda", 0))
        except errors.NoDriverError as e:
            dist.barrier()  # rank 0 has cleaned up
            runtime_dir = os.environ["XDG_RUNTIME_DIR"]
            left = [n for n in os.listdir(runtime_dir) if n.startswith("tpar-")]
            assert not left, f"rank 0's rendezvous directory left behind in {runtime_dir}: {left}"
            return str(e)
        raise AssertionError("from_group did not raise NoDriverError")

    def adapter_without_driver():
        from tp_allreduce.integrations.sglang import TpAllreduceCustomAllreduce

        ca = TpAllreduceCustomAllreduce(group=dist.group.WORLD, device="cuda:0")
        assert ca.disabled and ca.original_disabled and ca.comm is None
        for r in range(world):
            assert f"rank {r}: NoDriverError" in ca.disabled_reason, ca.disabled_reason
        return ca.disabled_reason

    rec.run("gather_object", gather)
    rec.run("from_group_without_driver", from_group_without_driver)
    rec.run("adapter_without_driver", adapter_without_driver)


def socket_dir(id_text):
    """The private directory of a Unix id's string (`tpar1:unix:PATH:JOB`)."""
    return os.path.dirname(id_text.split(":", 2)[2].rsplit(":", 1)[0])


def from_group_failure_paths(rank, world, result):
    """from_group's protocol with the core's per-rank setup stood in (any
    machine, driver or not): when one rank cannot set up, every rank raises
    at once (its own error, or a RendezvousError naming the rank that
    failed), no rank goes on to join, and rank 0's rendezvous directory is
    removed."""
    from tp_allreduce import _core

    rec = Recorder(result)
    real_prepared, real_id = _core.PreparedRank, _core.Id

    def case(failing):
        made = []

        class RecordingId:
            @staticmethod
            def new_unix():
                made.append(real_id.new_unix())
                return made[-1]

        class Prepared:
            def __init__(self, device, algorithm=None):
                if rank == failing:
                    raise errors.DriverError(f"injected: rank {rank} cannot use device {device}")

            def join(self, *args, **kwargs):
                raise AssertionError("joined although a rank failed to set up")

        _core.PreparedRank, _core.Id = Prepared, RecordingId
        started = time.monotonic()
        try:
            Communicator.from_group(None, torch.device("cuda", 0))
            raise AssertionError("from_group succeeded")
        except errors.TpAllreduceError as e:
            took, error = time.monotonic() - started, e
        finally:
            _core.PreparedRank, _core.Id = real_prepared, real_id
        if rank == failing:
            assert isinstance(error, errors.DriverError) and "injected" in str(error), repr(error)
        else:
            assert isinstance(error, errors.RendezvousError), repr(error)
            assert f"rank {failing}: DriverError: injected" in str(error), str(error)
        assert took < 10, f"took {took:.1f} s"
        if rank == 0:
            assert len(made) == 1, made
            assert not os.path.exists(socket_dir(str(made[0]))), f"{made[0]}: directory left behind"
        dist.barrier()
        return f"{type(error).__name__} after {took:.2f} s: {error}"

    rec.run("rank_0_fails", lambda: case(0))
    rec.run("rank_1_fails", lambda: case(1))


# ---------------------------------------------------------------- lifecycle scenarios
# (test_gpu_lifecycle.py; world 2, rank r on GPU r % GPUs, so one GPU serves)
def local_device(rank):
    return torch.device("cuda", rank % torch.cuda.device_count())


class Records(logging.Handler):
    """Collects the records of the `tp_allreduce` loggers."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def lines(self, level=None, prefix="tp_allreduce"):
        return [
            (r.name, r.levelname, r.getMessage())
            for r in self.records
            if (level is None or r.levelno == level) and r.name.startswith(prefix)
        ]


def listen():
    handler = Records()
    logger = logging.getLogger("tp_allreduce")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


def logging_and_fallbacks(rank, world, result):
    """One INFO line per communicator at creation (transport, where the
    algorithm table comes from), through Python's logging; a WARNING the
    first time a captured call goes through the capture copy (expandable
    segments + a pull algorithm), not again; the captured graph's replays
    match the float64 reference."""
    rec = Recorder(result)
    device = local_device(rank)
    seed = shared_seed(rank)
    records = listen()

    def creation_line(comm, want):
        infos = [line for line in records.lines(logging.INFO) if "communicator rank" in line[2]]
        assert len(infos) == 1, f"expected one INFO line at creation, got {records.lines()}"
        name, _, message = infos[0]
        assert name.startswith("tp_allreduce.comm"), name
        for words in [f"communicator rank {rank} of {world}", "transport", "algorithms from"] + want:
            assert words in message, f"{words!r} not in {message!r}"
        return message

    def pull_with_capture_copy():
        records.records.clear()
        comm = Communicator.from_group(None, device, algorithm="one-shot-pull")
        try:  # the comm is closed on every path, so the peer is not left in a collective
            message = creation_line(comm, ["forced to one-shot-pull", "transport p2p"])
            rec.facts[f"rank {rank}: library warnings at creation"] = records.lines(logging.WARNING)
            assert not records.lines(logging.WARNING, prefix="tp_allreduce.python"), records.lines()
            shape, dt = (3, 7168), torch.bfloat16
            static = torch.zeros(shape, dtype=dt, device=device)
            if pointer_is_ipc_exportable(static.data_ptr()):
                raise AssertionError("the premise failed: expandable-segments memory is exportable here")
            comm.all_reduce(static)  # warm-up
            comm.synchronize()
            graphs = []
            for _ in range(2):  # the warning comes once per communicator
                g = torch.cuda.CUDAGraph()
                with comm.capture():
                    with torch.cuda.graph(g):
                        out = comm.all_reduce(static)
                graphs.append((g, out))
            warnings = records.lines(logging.WARNING, prefix="tp_allreduce.python")
            assert len(warnings) == 1, f"expected one WARNING, got {records.lines()}"
            name, _, text = warnings[0]
            assert name == "tp_allreduce.python" and "captured" in text and "copy" in text, warnings[0]
            assert comm.core.captured_copies >= 2, comm.core.captured_copies
            problems = []
            for i, (g, out) in enumerate(graphs):
                case = next(_case)
                static.copy_(rank_input(seed, case, rank, shape, dt))
                out.fill_(NAN)
                g.replay()
                comm.synchronize()
                problems.append(mismatch(out, reference(seed, case, world, shape, dt), dt, f"graph {i}"))
            raise_if(problems)
        finally:
            comm.close()
        return f"INFO: {message} | WARNING: {text}"

    def host_staged_by_configuration():
        records.records.clear()
        os.environ["TP_ALLREDUCE_TRANSPORT"] = "host-staged"
        try:
            comm = Communicator.from_group(None, device)
        finally:
            del os.environ["TP_ALLREDUCE_TRANSPORT"]
        try:
            message = creation_line(comm, ["transport host-staged", "forced"])
            case = next(_case)
            x = rank_input(seed, case, rank, (4096,), torch.float32).to(device)
            out = torch.full_like(x, NAN)
            comm.all_reduce(x, out=out)
            comm.synchronize()
            raise_if([mismatch(out, reference(seed, case, world, (4096,), torch.float32), torch.float32, "eager")])
        finally:
            comm.close()
        return message

    rec.run("pull_with_capture_copy", pull_with_capture_copy)
    rec.run("host_staged_by_configuration", host_staged_by_configuration)


def ticking():
    """A Python thread that counts while it gets the GIL; returns
    (counter list, stop event, thread)."""
    count, stop = [0], threading.Event()

    def tick():
        while not stop.is_set():
            count[0] += 1
            time.sleep(0.005)

    t = threading.Thread(target=tick, daemon=True)
    t.start()
    return count, stop, t


def teardown_keeps_python_running(rank, world, result):
    """Rank 1's teardown (drop, then close) waits ~3 s for rank 0 in the
    teardown barrier; meanwhile another Python thread of rank 1 must keep
    running (the GIL is released). Also: closing twice is a no-op, a
    closed communicator refuses calls."""
    rec = Recorder(result)
    device = local_device(rank)
    delay = 3.0

    def one(how):
        comm = Communicator.from_group(None, device)
        x = torch.ones(4096, device=device)
        comm.all_reduce_(x)
        comm.synchronize()
        dist.barrier()
        if rank == 0:
            time.sleep(delay)  # rank 1 waits for this rank in the teardown barrier
            comm.close()
            return "delayed its teardown"
        count, stop, t = ticking()
        time.sleep(0.1)
        before, started = count[0], time.monotonic()
        if how == "drop":
            del comm
            gc.collect()
        else:
            comm.close()
        took, ticks = time.monotonic() - started, count[0] - before
        stop.set()
        t.join()
        assert took > delay / 2, f"the teardown took {took:.2f} s: it did not wait for rank 0 (test premise)"
        assert ticks > took / 0.005 / 4, f"{ticks} ticks in {took:.2f} s: Python threads were frozen (GIL held)"
        if how == "close":
            comm.close()  # a no-op
            assert comm.closed
            try:
                comm.all_reduce_(x)
                raise AssertionError("a closed communicator accepted a call")
            except errors.InvalidUsage as e:
                assert "closed" in str(e), e
        return f"{how}: {took:.2f} s, {ticks} ticks of another thread meanwhile"

    rec.run("drop", lambda: one("drop"))
    rec.run("close", lambda: one("close"))


def close_reports_a_failed_teardown(rank, world, result):
    """Rank 0's process ends without a teardown; rank 1's close() must raise
    (before: it returned None), and be closed anyway."""
    rec = Recorder(result)
    device = local_device(rank)
    comm = Communicator.from_group(None, device)
    x = torch.ones(4096, device=device)
    comm.all_reduce_(x)
    comm.synchronize()
    dist.barrier()
    if rank == 0:
        os._exit(0)  # no teardown, no result: the parent expects this rank to die

    def close():
        time.sleep(1.0)
        started = time.monotonic()
        try:
            comm.close()
        except errors.TpAllreduceError as e:
            assert comm.closed, "closed even though the teardown failed"
            return f"raised {type(e).__name__} after {time.monotonic() - started:.2f} s: {e}"
        raise AssertionError("close() returned normally although rank 0 never tore down")

    rec.run("close_raises", close)


def from_group_rank0_fails_before_joining(rank, world, result):
    """Rank 0 cannot set up (a device ordinal that does not exist); rank 1
    can. Rank 0 raises its own DriverError, rank 1 a RendezvousError naming
    rank 0 within seconds (before: the rendezvous timeout, 60 s), and rank
    0's rendezvous directory is gone (XDG_RUNTIME_DIR is the test's)."""
    rec = Recorder(result)
    runtime_dir = os.environ["XDG_RUNTIME_DIR"]

    def run():
        device = torch.device("cuda", torch.cuda.device_count()) if rank == 0 else local_device(rank)
        started = time.monotonic()
        try:
            Communicator.from_group(None, device)
        except errors.TpAllreduceError as e:
            took = time.monotonic() - started
            if rank == 0:
                assert isinstance(e, errors.DriverError), repr(e)
            else:
                assert isinstance(e, errors.RendezvousError) and "rank 0: DriverError" in str(e), repr(e)
            assert took < 15, f"took {took:.1f} s"
            dist.barrier()  # rank 0 has cleaned up
            left = [n for n in os.listdir(runtime_dir) if n.startswith("tpar-")]
            assert not left, f"left behind in {runtime_dir}: {left}"
            return f"{type(e).__name__} after {took:.2f} s: {e}"
        raise AssertionError("from_group succeeded with an invalid device on rank 0")

    rec.run("fails_fast_and_cleans_up", run)


KEEP = []  # communicators dropped only when the interpreter finalizes


def exit_without_close(rank, world, result):
    """Communicators left for interpreter shutdown (module globals): the
    process must still exit cleanly (the test checks the exit codes)."""
    rec = Recorder(result)
    device = local_device(rank)
    seed = shared_seed(rank)

    def run():
        comm = Communicator.from_group(None, device)
        case = next(_case)
        x = rank_input(seed, case, rank, (4096,), torch.float32).to(device)
        out = torch.full_like(x, NAN)
        comm.all_reduce(x, out=out)
        comm.synchronize()
        raise_if([mismatch(out, reference(seed, case, world, (4096,), torch.float32), torch.float32, "eager")])
        KEEP.append(comm)
        return "kept for shutdown"

    rec.run("kept", run)


class RawStreams:
    """Streams created and destroyed through the driver (PyTorch pools its
    own streams and never destroys them), wrapped for `torch.cuda.stream`."""

    def __init__(self, device):
        import ctypes

        self.device = device
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.ctypes = ctypes
        self.destroy_fn = getattr(self.lib, "cuStreamDestroy_v2", None) or self.lib.cuStreamDestroy

    def create(self):
        handle = self.ctypes.c_void_p()
        torch.cuda.synchronize(self.device)  # makes the device's primary context current on this thread
        rc = self.lib.cuStreamCreate(self.ctypes.byref(handle), 1)  # CU_STREAM_NON_BLOCKING
        assert rc == 0, f"cuStreamCreate: {rc}"
        return handle.value, torch.cuda.ExternalStream(handle.value, device=self.device)

    def destroy(self, handle):
        rc = self.destroy_fn(self.ctypes.c_void_p(handle))
        assert rc == 0, f"cuStreamDestroy: {rc}"


def stream_churn(rank, world, result):
    """Each round: one allreduce on the default stream and one inside
    `torch.cuda.stream(tmp)` on a temporary stream, synchronise, delete the
    stream and the buffers (`del`, `gc.collect()`), repeat; variants where
    the temporary streams are destroyed (driver streams) and where a new
    stream is created right after the old one is destroyed (its handle may
    reuse the address). Every result against the float64 reference, outputs
    poisoned."""
    rec = Recorder(result)
    device = local_device(rank)
    seed = shared_seed(rank)
    comm = Communicator.from_group(None, device)
    rounds = 6
    specs = [((3, 7168), torch.bfloat16), ((4096,), torch.float32)]

    def reduce_checked(what, problems):
        for shape, dt in specs:
            case = next(_case)
            x = rank_input(seed, case, rank, shape, dt).to(device)
            out = torch.full_like(x, NAN)
            comm.all_reduce(x, out=out)
            inplace = rank_input(seed, case, rank, shape, dt).to(device)
            comm.all_reduce_(inplace)
            torch.cuda.current_stream(device).synchronize()
            ref = reference(seed, case, world, shape, dt)
            problems.append(mismatch(out, ref, dt, f"{what} {dt} out="))
            problems.append(mismatch(inplace, ref, dt, f"{what} {dt} in place"))
            del x, out, inplace

    def pooled():
        problems = []
        for r in range(rounds):
            reduce_checked(f"round {r} default stream", problems)
            tmp = torch.cuda.Stream(device)
            tmp.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(tmp):
                reduce_checked(f"round {r} temporary stream", problems)
            torch.cuda.synchronize(device)
            del tmp
            gc.collect()
        raise_if(problems)
        return f"{rounds} rounds x {len(specs)} sizes x (out=, in place)"

    def destroyed(recreate_at_once):
        raw = RawStreams(device)
        problems, reused = [], 0
        handle, tmp = raw.create()
        for r in range(rounds):
            reduce_checked(f"round {r} default stream", problems)
            with torch.cuda.stream(tmp):
                reduce_checked(f"round {r} driver stream {handle:#x}", problems)
            torch.cuda.synchronize(device)
            old = handle
            del tmp
            gc.collect()
            raw.destroy(old)
            if not recreate_at_once:
                reduce_checked(f"round {r} default stream after destroying {old:#x}", problems)
            handle, tmp = raw.create()
            reused += handle == old
        del tmp
        torch.cuda.synchronize(device)
        raw.destroy(handle)
        raise_if(problems)
        return f"{rounds} rounds; a new stream got the destroyed one's handle {reused} times"

    rec.run("pooled_temporary_streams", pooled)
    rec.run("destroyed_streams", lambda: destroyed(False))
    rec.run("new_stream_right_after_destroying", lambda: destroyed(True))
    comm.close()


def gather_scatter(rank, world, result):
    """`Communicator.all_gather` and `reduce_scatter` over dimension 0,
    every dtype, odd row counts, eager and inside a captured CUDA graph
    replayed with fresh inputs: all-gather bit for bit against every rank's
    input, reduce-scatter against the float64 sum; outputs poisoned."""
    rec = Recorder(result)
    device = local_device(rank)
    seed = shared_seed(rank)
    comm = Communicator.from_group(None, device)
    shapes = [(1,), (7, 3), (3, 7168), (1001, 5)]

    def eager():
        problems = []
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            for shape in shapes:
                case = next(_case)
                x = rank_input(seed, case, rank, shape, dt).to(device)
                out = torch.full((world * shape[0], *shape[1:]), NAN, dtype=dt, device=device)
                comm.all_gather(x, out=out)
                got = comm.all_gather(x)  # a new tensor
                torch.cuda.current_stream(device).synchronize()
                want = torch.cat([rank_input(seed, case, r, shape, dt) for r in range(world)]).to(device)
                for what, t in (("out=", out), ("new", got)):
                    if t.shape != want.shape or not torch.equal(t, want):
                        problems.append(f"all_gather {dt} {shape} {what}: differs from the concatenation")
                big = (world * shape[0], *shape[1:])
                y = rank_input(seed, case, rank, big, dt).to(device)
                part = torch.full((shape[0], *shape[1:]), NAN, dtype=dt, device=device)
                comm.reduce_scatter(y, out=part)
                torch.cuda.current_stream(device).synchronize()
                ref = reference(seed, case, world, big, dt)[rank * shape[0] : (rank + 1) * shape[0]]
                problems.append(mismatch(part, ref, dt, f"reduce_scatter {dt} {shape}"))
        raise_if(problems)
        return f"{3 * len(shapes)} cases x (all_gather out= and new, reduce_scatter)"

    def captured():
        shape, dt = (3, 7168), torch.bfloat16
        x = torch.zeros(shape, dtype=dt, device=device)
        y = torch.zeros((world * 3, 7168), dtype=dt, device=device)
        gathered = torch.full((world * 3, 7168), NAN, dtype=dt, device=device)
        part = torch.full(shape, NAN, dtype=dt, device=device)
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            with comm.capture():
                with torch.cuda.graph(g, stream=s):
                    comm.all_gather(x, out=gathered)
                    comm.reduce_scatter(y, out=part)
        torch.cuda.current_stream(device).wait_stream(s)
        problems = []
        for replay in range(20):
            case = next(_case)
            x.copy_(rank_input(seed, case, rank, shape, dt).to(device))
            y.copy_(rank_input(seed, case + 1_000_000, rank, (world * 3, 7168), dt).to(device))
            g.replay()
            torch.cuda.synchronize(device)
            want = torch.cat([rank_input(seed, case, r, shape, dt) for r in range(world)]).to(device)
            if not torch.equal(gathered, want):
                problems.append(f"replay {replay}: all_gather differs from the concatenation")
            ref = reference(seed, case + 1_000_000, world, (world * 3, 7168), dt)[rank * 3 : (rank + 1) * 3]
            problems.append(mismatch(part, ref, dt, f"replay {replay}: reduce_scatter"))
        raise_if(problems)
        return "20 replays with fresh inputs"

    rec.run("eager", eager)
    rec.run("captured", captured)
    comm.close()
