"""What each rank runs in the GPU tests (one process per GPU, a gloo world
group; see `_spawn`). Every check records ok/detail instead of raising,
and does all of its collective calls before asserting, so a wrong value on
one rank does not leave the other waiting.

Inputs are fresh random values from a seed rank 0 draws per run; every rank
can rebuild every rank's input, so the f64 reference needs no
communication. Outputs are poisoned with NaN before each call or replay.
"""

import itertools
import os
import random
import traceback

import torch
import torch.distributed as dist
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
