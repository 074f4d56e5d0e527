"""One rank of the SGLang check (started by run_checks.py; SGLang 0.5.23's
own parallel_state, custom-allreduce dispatch, graph_capture and RMSNorm,
tp-allreduce activated by the pip-installed .pth with TP_ALLREDUCE_SGLANG=1).

    python -m engine_checks.sglang_check RANK WORLD PORT OUT_DIR [--dry-run]

Rank r uses GPU r % GPUs, and SGLang gets that index as its local rank
(SGLang puts its groups on cuda:<local rank>): with one GPU both ranks are
on cuda:0. ``--dry-run`` (no GPU): SGLang's setup and teardown on CPU.
"""

import sys

import torch
import torch.distributed as dist

from engine_checks import common
from engine_checks.common import (
    NAN,
    PEER_TIMEOUT,
    CallCounter,
    Recorder,
    bitwise_across_ranks,
    everyone,
    fresh,
    engine_modules,
    imported_distributions,
    mismatch,
    raise_if,
    rank_process_start,
    reference,
    stubs_loaded,
)

MIB8 = 8 << 20
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def eager_sizes(dtype):
    """Element counts: odd, small, a verify pass' 3 x 7168, either side of
    SGLang's 8 MiB limit."""
    elem = torch.empty((), dtype=dtype).element_size()
    limit = MIB8 // elem
    return [1, 7, 1000, 3 * 7168, 3 * 7168 + 5, limit - 8, limit, limit + 8]


def body_imports():
    """Everything the check imports besides setup's (the dry run imports
    these too)."""
    import sglang
    from sglang.srt.distributed import tensor_model_parallel_all_reduce
    from sglang.srt.distributed.device_communicators import custom_all_reduce as car
    from sglang.srt.layers import flashinfer_comm_fusion
    from sglang.srt.layers.layer_boundary.residual import add_norm
    from sglang.srt.layers.layernorm import RMSNorm
    from tp_allreduce.integrations.sglang import TpAllreduceCustomAllreduce

    return {
        "sglang": sglang,
        "tensor_model_parallel_all_reduce": tensor_model_parallel_all_reduce,
        "car": car,
        "fusion": flashinfer_comm_fusion,
        "add_norm": add_norm,
        "RMSNorm": RMSNorm,
        "TpAllreduceCustomAllreduce": TpAllreduceCustomAllreduce,
    }


def patches_installed():
    """What must hook SGLang once its plugins are loaded (a list of
    problems): the four targets, through SGLang's HookRegistry (SGLang 0.5.23
    has plugins; the .pth path must not have patched them itself)."""
    body_imports()
    from tp_allreduce.integrations.sglang import hooks_applied

    return [f"{target}: hooked by {how}, expected SGLang's HookRegistry (plugin)" for target, how in hooks_applied().items() if how != "plugin"]


def server_args(world):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path="dummy", tp_size=world)


def setup(rank, world, port, local_rank, shared_gpu):
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context

    backend = "gloo" if shared_gpu else "nccl"
    if shared_gpu:
        # NCCL refuses two ranks on one GPU: gloo device groups and no pynccl.
        original = ps.init_model_parallel_group

        def no_pynccl(*args, **kwargs):
            kwargs["use_pynccl"] = False
            return original(*args, **kwargs)

        ps.init_model_parallel_group = no_pynccl
    ps.init_distributed_environment(
        world_size=world,
        rank=rank,
        local_rank=local_rank,
        backend=backend,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        timeout=int(PEER_TIMEOUT.total_seconds()),
    )
    # SGLang's own test fixture (sglang/test/test_utils.py publish_build_topology).
    reset_context()
    publish(server_args(world), role="test", ranks=SpawnRanks(world_rank=rank))
    get_parallel().override_permanently(world_group=ps._WORLD)
    ps.initialize_model_parallel(backend=backend)
    common.GATHER_GROUP = ps.get_world_group().cpu_group
    return ps


def main():
    rank, world, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dry_run = "--dry-run" in sys.argv[5:]
    rec = Recorder("sglang", rank, out_dir)
    rec.guard(lambda: run(rec, rank, world, port, dry_run))


def run(rec, rank, world, port, dry_run):
    index, gpus, shared_gpu = rank_process_start(rank, world)
    if not dry_run and gpus == 0:
        raise RuntimeError("no GPU visible (torch.cuda.device_count() == 0)")
    local_rank = 0 if index is None else index
    rec.facts.update(local_rank=local_rank, gpus=gpus)
    rec.running = "setup (init_distributed_environment, publish, initialize_model_parallel)"
    ps = setup(rank, world, port, local_rank, shared_gpu)
    rec.running = None
    if dry_run:
        dry_body(rec, ps, rank, world)
    else:
        body(rec, ps, rank, world, shared_gpu)
    rec.facts["distributions"] = imported_distributions()
    rec.facts["modules"] = engine_modules()


def dry_body(rec, ps, rank, world):
    """CPU: SGLang's groups and tp-allreduce's adapter on them (which cannot
    start without a GPU and must say so on every rank), the reference
    helpers over gloo, the teardown."""
    tp = ps.get_tp_group()
    attn = ps.get_attn_tp_group()

    def hooks():
        raise_if(patches_installed())
        body_imports()
        return ("SGLang's load_plugins() (run by the .pth trigger at the first GroupCoordinator) applied tp-allreduce's hooks: "
                "dispatcher, fused entry, its gate, the all-gather call site; the check's imports load")

    rec.run("patches_and_imports", hooks)

    def adapter_on_cpu():
        m = body_imports()
        problems = []
        for name, g in (("tp", tp), ("attn_tp", attn)):
            ca = g.ca_comm
            if not isinstance(ca, m["TpAllreduceCustomAllreduce"]):
                problems.append(f"{name}: ca_comm is {type(ca).__name__}, not tp-allreduce's (device {g.device})")
                continue
            why = ca.disabled_reason or ""
            if not ca.disabled or not all(f"rank {r}:" in why for r in range(world)):
                problems.append(f"{name}: expected disabled on CPU with every rank's reason, got disabled={ca.disabled} reason={why!r}")
        from tp_allreduce.integrations import COUNTER_KEYS, counters

        got = counters()
        if set(got) != set(COUNTER_KEYS) | {"groups"} or any(got.values()):
            problems.append(f"counters() with every adapter disabled: {got}, expected all 0")
        if set(getattr(tp.ca_comm, "counters", {})) != set(COUNTER_KEYS):
            problems.append(f"ca_comm.counters: {getattr(tp.ca_comm, 'counters', None)}")
        raise_if(problems)
        return f"tp group on {tp.device}, local_rank {tp.local_rank}: {tp.ca_comm.disabled_reason}; counters() {got}"

    rec.run("adapter_built_and_disabled_on_cpu", adapter_on_cpu)

    def helpers():
        x = fresh((1000,), torch.bfloat16, "cpu")
        ref = reference(x)
        problems = [bitwise_across_ranks(ref.to(torch.bfloat16), "reference")]
        if mismatch(ref + 1.0, ref, torch.bfloat16, "shifted") is None:
            problems.append("mismatch() accepted a result off by 1.0")
        if mismatch(ref * NAN, ref, torch.bfloat16, "poisoned") is None:
            problems.append("mismatch() accepted NaN")
        raise_if(problems)
        return "reference, bitwise comparison and mismatch over the world CPU group"

    rec.run("reference_helpers", helpers)

    def compiled():
        from engine_checks.compile_check import fullgraph_meta

        return fullgraph_meta()

    rec.run("torch_compile_fullgraph_meta", compiled)

    def eager_and_norm():
        """SGLang's all-reduce and RMSNorm on CPU tensors. The fused entry
        (forward_with_allreduce_fusion -> the patched
        flashinfer_allreduce_residual_rmsnorm) finds tp-allreduce disabled and
        hands the call to SGLang's own op, which SGLang registers for CUDA
        only: on CPU that op refuses the tensors, and that refusal is what
        shows the hand-over."""
        m = body_imports()
        dt, hidden = torch.bfloat16, 7168
        x = fresh((3, hidden), dt, "cpu")
        y = m["tensor_model_parallel_all_reduce"](x.clone())
        problems = [mismatch(y, reference(x), dt, "tensor_model_parallel_all_reduce (cpu)")]
        norm = m["RMSNorm"](hidden, eps=1e-6).to(dtype=dt)
        with torch.no_grad():
            norm.weight.copy_(same_everywhere(fresh((hidden,), dt, "cpu") + 1.5))
        res = everyone(fresh((3, hidden), dt, "cpu"))[0].to(dt)  # rank 0's residual on every rank
        s = reference(fresh((3, hidden), dt, "cpu") * 0.05).to(dt)
        out, res_out = norm.forward_native(s, res.clone())
        want_res = (res.double() + s.double()).to(dt).double()
        inv = (want_res.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
        want = (want_res * inv * norm.weight.double()).to(dt).double()
        problems += [
            mismatch(res_out, want_res, dt, "residual out"),
            mismatch(out, want, dt, "normed", scale=2 * want.abs()),
        ]
        try:
            norm.forward_with_allreduce_fusion(x, res.clone())
            problems.append("the fused entry ran on CPU tensors: expected SGLang's CUDA-only op to refuse them")
        except NotImplementedError as e:
            if "sglang::flashinfer_allreduce_residual_rmsnorm" not in str(e):
                problems.append(f"the fused entry failed elsewhere: {str(e).splitlines()[0]}")
        raise_if(problems)
        return "all-reduce and RMSNorm.forward_native on CPU match the reference; the patched fused entry handed the call to SGLang's own op"

    rec.run("all_reduce_norm_and_fused_entry_on_cpu", eager_and_norm)

    def layer_chain():
        """The 61-layer check's models and tolerance against SGLang's own
        unfused path run eagerly on CPU (its all-reduce, then
        RMSNorm.forward_native), and against the same chain with one rank's
        partial left out of one layer (must match neither model)."""
        m = body_imports()
        dt, hidden, layers = torch.bfloat16, 7168, 61
        norms = [m["RMSNorm"](hidden, eps=1e-6).to(dtype=dt) for _ in range(layers)]
        for n in norms:
            with torch.no_grad():
                n.weight.copy_(same_everywhere(fresh((hidden,), dt, "cpu") + 1.5))
        res0 = everyone(fresh((3, hidden), dt, "cpu"))[0].to(dt)
        partials = [fresh((3, hidden), dt, "cpu") * 0.05 for _ in range(layers)]

        def chain(skip=None):
            x, res = None, res0.clone()
            for i, n in enumerate(norms):
                s = m["tensor_model_parallel_all_reduce"](partials[i].clone())
                if i == skip:
                    s = partials[i].clone()  # this rank's partial alone
                x, res = n.forward_native(s, res)
            return x, res

        models = layer_models(norms, partials, res0, dt)
        problems, matched = rounding_problems({"unfused_sglang (cpu)": chain()}, models, dt)
        if matched.get("unfused_sglang (cpu)") != "sum rounded to the dtype first":
            problems.append(f"SGLang's unfused path matched {matched}, expected the model that rounds the sum first")
        wrong, _ = rounding_problems({"one partial missing in layer 30": chain(skip=30)}, models, dt)
        if not [p for p in wrong if p and "bitwise" not in p and "differ" not in p]:
            problems.append("a chain missing one rank's partial in layer 30 passed the 61-layer comparison")
        raise_if(problems)
        return f"SGLang's unfused chain matches '{matched['unfused_sglang (cpu)']}' within one ulp; a missing partial does not"

    rec.run("layer_chain_reference_on_cpu", layer_chain)
    rec.run("destroy_model_parallel", lambda: (ps.destroy_model_parallel(), "destroy_model_parallel() returned")[1])


def body(rec, ps, rank, world, shared_gpu):
    m = body_imports()
    sglang = m["sglang"]
    tensor_model_parallel_all_reduce = m["tensor_model_parallel_all_reduce"]
    TpAllreduceCustomAllreduce = m["TpAllreduceCustomAllreduce"]

    tp = ps.get_tp_group()
    attn = ps.get_attn_tp_group()
    device = tp.device
    rec.facts.update(
        sglang=sglang.__version__,
        torch=torch.__version__,
        gpu=torch.cuda.get_device_name(device),
        mode="2 processes on one GPU (MPS), gloo device groups, no pynccl" if shared_gpu else "one GPU per process",
        tp_ca_comm=type(tp.ca_comm).__name__,
        attn_ca_comm=type(attn.ca_comm).__name__,
        stubs=stubs_loaded(),
    )
    counters = {}

    def activation():
        problems = patches_installed()
        for name, g in (("tp", tp), ("attn_tp", attn)):
            ca = g.ca_comm
            ours = getattr(ca, "_tpa", ca)
            if not isinstance(ours, TpAllreduceCustomAllreduce) or ours.disabled or ca.disabled:
                problems.append(f"{name}: ca_comm is {type(ca).__name__}, disabled reason {getattr(ours, 'disabled_reason', None)}")
            elif id(ours.comm) not in counters:
                counters[id(ours.comm)] = CallCounter(ours.comm)
        raise_if(problems)
        return f"tp and attention-tp groups on {device}: {type(tp.ca_comm).__name__}; same object: {tp.ca_comm is attn.ca_comm}"

    if not rec.run("activation", activation):
        # Every later check counts calls through tp-allreduce: without it
        # they would fail for this one reason; SGLang's teardown still runs.
        rec.run("destroy_model_parallel", lambda: (ps.destroy_model_parallel(), "destroy_model_parallel() returned")[1])
        return
    tp_counter = counters.get(id(getattr(getattr(tp.ca_comm, "_tpa", tp.ca_comm), "comm", None)))

    def eager():
        problems, ours_before, n = [], tp_counter.get("all_reduce"), 0
        from tp_allreduce.integrations import counters as user_counters

        user_before = user_counters()
        expected_ours = 0
        for dtype in DTYPES:
            for count in eager_sizes(dtype):
                x = fresh((count,), dtype, device)
                before = x.clone()
                if tp.ca_comm.should_custom_ar(x):
                    expected_ours += 1
                y = tensor_model_parallel_all_reduce(x)
                torch.cuda.synchronize()
                what = f"{dtype} n={count}"
                problems += [
                    mismatch(y, reference(before), dtype, what),
                    bitwise_across_ranks(y, what),
                    None if y.data_ptr() == x.data_ptr() or torch.equal(x, before) else f"{what}: input changed",
                ]
                n += 1
        rec.calls += n
        ours = tp_counter.get("all_reduce") - ours_before
        if ours != expected_ours or ours == 0:
            problems.append(f"{ours} of {n} calls reached tp-allreduce, expected {expected_ours}")
        # What a user reads (tp_allreduce.integrations.counters()) says the same.
        user = {k: v - user_before[k] for k, v in user_counters().items()}
        if user["ours"] != ours or user["declined"] < n - expected_ours:
            problems.append(f"counters() moved by {user}; expected ours={ours}, declined >= {n - expected_ours}")
        raise_if(problems)
        return f"{n} calls, {ours} through tp-allreduce (the rest: SGLang's own path above 8 MiB); counters() {user}"

    rec.run("eager_all_reduce", eager)

    # ---- graphs: SGLang's CudaGraphRunner order
    hidden = 7168
    pool = torch.cuda.graph_pool_handle()

    def forward(x):
        h = tensor_model_parallel_all_reduce(x)
        h = ps.get_attn_tp_group().all_reduce(h * 0.5)
        return tensor_model_parallel_all_reduce(h + 1.0)

    def expected(xs_all):  # f64 model of forward from every rank's input
        s = sum(xs_all)
        h = s.to(torch.bfloat16).double()
        h = (world * (h * 0.5).to(torch.bfloat16).double()).to(torch.bfloat16).double()
        return world * (h + 1.0).to(torch.bfloat16).double()

    def capture_window(sizes, label):
        graphs = {}
        problems = []
        with ps.graph_capture() as ctx:
            for bs in sorted(sizes, reverse=True):
                static = fresh((bs, hidden), torch.bfloat16, device)
                dist.barrier(group=tp.cpu_group)
                for _ in range(2):  # warm-ups inside the capture context, outside a graph
                    static.copy_(fresh((bs, hidden), torch.bfloat16, device))
                    warm = forward(static)
                    torch.cuda.synchronize()
                    problems.append(
                        mismatch(warm, expected(everyone(static)), torch.bfloat16, f"{label} warm-up bs={bs}", scale=world * world * 2)
                    )
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=ctx.stream):
                    out = forward(static)
                graphs[bs] = (g, static, out)
        raise_if(problems)
        return graphs

    windows = {}

    def capture1():
        before = tp_counter.get("all_reduce")
        windows["first"] = capture_window([1, 3, 8, 32], "window 1")
        return f"4 batch sizes largest first, tp-allreduce calls during capture: {tp_counter.get('all_reduce') - before}"

    def replay_all(label):
        problems = []
        for replay in range(3):
            for name, graphs in windows.items():
                for bs, (g, static, out) in graphs.items():
                    static.copy_(fresh(static.shape, torch.bfloat16, device))
                    out.fill_(NAN)
                    g.replay()
                    torch.cuda.synchronize()
                    what = f"{label} {name} bs={bs} replay {replay}"
                    problems.append(mismatch(out, expected(everyone(static)), torch.bfloat16, what, scale=world * world * 2))
                    problems.append(bitwise_across_ranks(out, what))
                    rec.calls += 1
                    # an eager call in between, as the scheduler's eager paths do
                    x = fresh((5, 1024), torch.bfloat16, device)
                    y = tensor_model_parallel_all_reduce(x)
                    torch.cuda.synchronize()
                    problems.append(mismatch(y, reference(x), torch.bfloat16, f"eager between ({what})"))
                    rec.calls += 1
        raise_if(problems)
        return f"{sum(len(g) for g in windows.values())} graphs x 3 replays with fresh inputs, eager calls interleaved"

    rec.run("graph_capture_window_1", capture1)
    rec.run("replays_window_1", lambda: replay_all("after window 1"))

    def capture2():
        windows["second"] = capture_window([2, 16], "window 2")
        return "a second graph_capture() window (2 more sizes), first window's graphs kept"

    rec.run("graph_capture_window_2", capture2)
    rec.run("replays_both_windows", lambda: replay_all("after window 2"))

    rec.run("fused_rmsnorm_61_layers", lambda: fused_layers(rec, ps, tp, device, world, pool))
    rec.facts["tp_allreduce_calls"] = dict(tp_counter.counts) if tp_counter else {}

    def destroy():
        for g in windows.values():
            for graph, _, _ in g.values():
                del graph
        windows.clear()
        torch.cuda.synchronize()
        ps.destroy_model_parallel()
        return "destroy_model_parallel() returned"

    rec.run("destroy_model_parallel", destroy)


def same_everywhere(t):
    """Rank 0's values of ``t`` on every rank (over gloo; exact for
    float16/bfloat16/float32 through float64), on ``t``'s device and dtype."""
    return everyone(t)[0].to(dtype=t.dtype, device=t.device)


def layer_models(norms, partials, residual, dt):
    """The f64 models of a chain of layers (each: the ranks' partials summed
    into the residual, then the norm) from every rank's partials and the
    same residual everywhere (rank 0's). Two roundings of the sum are both
    right: added to the residual in f32 and rounded once (a fused kernel),
    or rounded to the dtype by an all-reduce first, then added (an
    all-reduce followed by the norm, as SGLang's own path); over 61 layers
    the two residuals drift apart by several ulps, so each variant is held
    to the model of its own rounding. {model: (normed, residual)}."""
    res0 = everyone(residual)[0]
    sums = [sum(everyone(p)) for p in partials]
    models = {}
    for model, round_sum in (("sum added in f32", False), ("sum rounded to the dtype first", True)):
        res, x = res0, None
        for s, n in zip(sums, norms):
            if round_sum:
                s = s.to(dt).double()
            res = (res + s).to(dt).double()
            inv = (res.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
            x = (res * inv * n.weight.double().cpu()).to(dt).double()
        models[model] = (x, res)
    return models


def rounding_problems(results, models, dt):
    """Each of ``results`` ({name: (normed, residual)}) against the models:
    within one ulp (2^-7 |want| for bf16: the norm computed in f32 against
    the f64 model flips a rounding now and then) of one of them, and the
    same bits on every rank. A wrong or missing partial in any layer is off
    by far more, in most elements. Returns (problems, {name: model})."""
    problems, matched = [], {}
    for name, (got_x, got_res) in results.items():
        misses = {}
        for model, (want_x, want_res) in models.items():
            misses[model] = [
                p
                for p in (
                    mismatch(got_x, want_x, dt, f"{name} normed ({model})", scale=2 * want_x.abs()),
                    mismatch(got_res, want_res, dt, f"{name} residual ({model})", scale=2 * want_res.abs()),
                )
                if p
            ]
        fits = [model for model, miss in misses.items() if not miss]
        if fits:
            matched[name] = fits[0]
        else:
            problems += [miss[0] for miss in misses.values()]
        problems.append(bitwise_across_ranks(got_x, f"{name} normed"))
        problems.append(bitwise_across_ranks(got_res, f"{name} residual"))
    return problems, matched


def fused_layers(rec, ps, tp, device, world, pool, layers=61, tokens=3, hidden=7168):
    """SGLang's own RMSNorm.forward_with_allreduce_fusion (which calls the
    patched flashinfer_allreduce_residual_rmsnorm) in a captured 61-layer
    verify-shaped graph, against the f64 reference, and timed against the
    unfused path (SGLang's all-reduce, then RMSNorm's native forward) and
    tp-allreduce's own unfused epilogue in the same run."""
    m = body_imports()
    RMSNorm = m["RMSNorm"]
    tensor_model_parallel_all_reduce = m["tensor_model_parallel_all_reduce"]

    dt = torch.bfloat16
    norms = [RMSNorm(hidden, eps=1e-6).to(device=device, dtype=dt) for _ in range(layers)]
    for n in norms:
        with torch.no_grad():
            # the same weights on every rank, as in a model (and as the fused
            # kernel's contract asks)
            n.weight.copy_(same_everywhere(fresh((hidden,), dt, device) + 1.5))
    ca = tp.ca_comm
    ours = getattr(ca, "_tpa", ca)
    counter = CallCounter(ours.comm) if not hasattr(ours.comm.all_reduce_add_rms_norm, "__wrapped_count__") else None
    x0 = fresh((tokens, hidden), dt, device)
    res0 = fresh((tokens, hidden), dt, device)
    partials = [fresh((tokens, hidden), dt, device) * 0.05 for _ in range(layers)]

    def fused(x, residual):
        for i, n in enumerate(norms):
            x, residual = n.forward_with_allreduce_fusion(x * 0 + partials[i], residual)
        return x, residual

    def unfused_sglang(x, residual):
        for i, n in enumerate(norms):
            s = tensor_model_parallel_all_reduce(x * 0 + partials[i])
            x, residual = n.forward_native(s, residual)
        return x, residual

    def unfused_ours(x, residual):
        for i, n in enumerate(norms):
            x, residual = ours.comm.all_reduce_add_rms_norm(x * 0 + partials[i], residual.clone(), n.weight, 1e-6, unfused=True)
        return x, residual

    # residual identical on every rank, as in a model: rank 0's (bf16 -> f64
    # -> bf16 is exact), over gloo
    res0.copy_(everyone(res0)[0].to(dt))
    results, times = {}, {}
    for name, fn in (("fused", fused), ("unfused_sglang", unfused_sglang), ("unfused_tp_allreduce", unfused_ours)):
        before = counter.get("all_reduce_add_rms_norm") if counter else 0
        with ps.graph_capture() as ctx:
            for _ in range(2):
                fn(x0, res0.clone())
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            res_in = res0.clone()
            with torch.cuda.graph(g, pool=pool, stream=ctx.stream):
                out = fn(x0, res_in)
        if name == "fused" and counter is not None:
            results["fused_calls_captured"] = counter.get("all_reduce_add_rms_norm") - before
        out[0].fill_(NAN)
        out[1].fill_(NAN)
        g.replay()
        torch.cuda.synchronize()
        results[name] = (out[0].clone(), out[1].clone())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(5):
            g.replay()
        dist.barrier(group=tp.cpu_group)
        start.record()
        for _ in range(50):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 50 * 1000  # us per graph
    models = layer_models(norms, partials, res0, dt)
    problems, matched = rounding_problems({k: results[k] for k in ("fused", "unfused_sglang", "unfused_tp_allreduce")}, models, dt)
    rec.calls += 3
    rec.facts["fused_61_layers_rounding"] = matched
    if counter is not None and results.get("fused_calls_captured", 0) < layers:
        problems.append(
            f"the fused graph reached tp-allreduce's fused call {results.get('fused_calls_captured')} times, expected >= {layers}"
        )
    rec.facts["fused_61_layers_us_per_graph"] = {k: round(v, 1) for k, v in times.items()}
    raise_if(problems)
    return "us per 61-layer graph: " + ", ".join(f"{k} {v:.1f} ({matched[k]})" for k, v in times.items())


if __name__ == "__main__":
    main()
