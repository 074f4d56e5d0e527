"""One rank of the vLLM check (started by run_checks.py): vLLM's own
platform resolution (``vllm.platforms.current_platform``, plugins from the
installed entry points), its tp ``GroupCoordinator`` and ``CudaCommunicator``;
the venv's vLLM (0.33.0 or 0.34.0, run_checks.py sets the version expected).

    python -m engine_checks.vllm_check RANK WORLD PORT OUT_DIR MODE [--dry-run]

MODE: ``on`` (TP_ALLREDUCE_VLLM=1 in the environment), ``off`` (vLLM's own
path), ``invariant`` (on, VLLM_BATCH_INVARIANT=1). Rank r uses GPU
r % GPUs and vLLM gets that index as its local rank (vLLM puts its groups
on cuda:<local rank>). ``--dry-run`` (no GPU): vLLM's setup and teardown
on CPU, NVML stood in (cpu_stand_ins.py) so that the platform is CUDA's.
"""

import inspect
import logging
import os
import sys

import torch

from engine_checks import common
from engine_checks.common import (
    NAN,
    PEER_TIMEOUT,
    CallCounter,
    NotRun,
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
from engine_checks.run_checks import EXPECT_VERSION, RUN_NAME


def body_imports():
    """What the check imports (the dry run imports these too)."""
    import vllm
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    from vllm.platforms import current_platform
    from vllm.platforms.cuda import CudaPlatform
    from vllm.plugins import load_general_plugins
    from vllm.ray.ray_env import get_env_vars_to_copy
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from tp_allreduce.integrations._adapter import SIZE_INDEPENDENT_ALGORITHMS

    return {
        "vllm": vllm,
        "VllmConfig": VllmConfig,
        "set_current_vllm_config": set_current_vllm_config,
        "ps": ps,
        "CudaCommunicator": CudaCommunicator,
        "current_platform": current_platform,
        "CudaPlatform": CudaPlatform,
        "resolve_obj_by_qualname": resolve_obj_by_qualname,
        "load_general_plugins": load_general_plugins,
        "get_env_vars_to_copy": get_env_vars_to_copy,
        "SIZE_INDEPENDENT_ALGORITHMS": SIZE_INDEPENDENT_ALGORITHMS,
    }


def platform_problems(mode):
    """vLLM's platform and plugins from the installed entry points, after
    ``load_general_plugins()`` (what every vLLM engine and worker process
    runs), against the mode: (problems, description). tp-allreduce is a
    general plugin: the platform stays vLLM's CUDA platform in every mode."""
    import importlib.metadata as md
    import os

    m = body_imports()
    m["load_general_plugins"]()
    platform = m["current_platform"]
    cls = type(platform)
    cc = m["resolve_obj_by_qualname"](platform.get_device_communicator_cls())
    problems = []
    want = os.environ.get(EXPECT_VERSION)
    if want and m["vllm"].__version__ != want:
        problems.append(f"this venv imports vLLM {m['vllm'].__version__} from {m['vllm'].__file__}, the run wants {want}")
    ours = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "tp_allreduce"]
    if ours != ["_tp_allreduce_boot:vllm_plugin"]:
        problems.append(f"vllm.general_plugins entry point tp_allreduce: {ours}")
    theirs = [e.value for e in md.entry_points(group="vllm.platform_plugins") if e.value.startswith("tp_allreduce")]
    if theirs:
        problems.append(f"tp-allreduce still registers a platform plugin: {theirs}")
    # vllm.platforms.cuda.CudaPlatform names NvmlCudaPlatform (or
    # NonNvmlCudaPlatform): compare classes, not names.
    if cls is not m["CudaPlatform"]:
        problems.append(f"the platform is {cls.__module__}.{cls.__qualname__}, not vLLM's CudaPlatform ({m['CudaPlatform'].__name__})")
    if cc is not m["CudaCommunicator"]:
        problems.append(f"device communicator class {cc} is not vLLM's CudaCommunicator")
    installed = bool(m["CudaCommunicator"].__dict__.get("_tp_allreduce_installed"))
    if installed != (mode != "off"):
        problems.append(f"tp-allreduce installed into CudaCommunicator: {installed}, mode {mode}")
    # Ray: vLLM copies to its actors what get_env_vars_to_copy names.
    copied = m["get_env_vars_to_copy"](destination="check")
    forwarded = "TP_ALLREDUCE_VLLM" in copied
    if forwarded != (mode != "off"):
        problems.append(f"TP_ALLREDUCE_VLLM among the variables vLLM copies to Ray actors: {forwarded}, mode {mode}")
    return problems, (
        f"vLLM {m['vllm'].__version__}: {cls.__name__} (vLLM's own); device communicator: vLLM's CudaCommunicator, tp-allreduce installed: "
        f"{installed}; forwarded to Ray actors: {forwarded} "
        f"(VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY={os.environ.get('VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY', '')!r})"
    )


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main():
    rank, world, port, out_dir, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    dry_run = "--dry-run" in sys.argv[6:]
    rec = Recorder(os.environ.get(RUN_NAME, f"vllm-{mode}"), rank, out_dir)
    rec.guard(lambda: run(rec, rank, world, port, mode, dry_run))


def run(rec, rank, world, port, mode, dry_run):
    index, gpus, shared_gpu = rank_process_start(rank, world)
    if not dry_run and gpus == 0:
        raise RuntimeError("no GPU visible (torch.cuda.device_count() == 0)")
    if dry_run:
        from engine_checks.cpu_stand_ins import pretend_nvml

        pretend_nvml()
    local_rank = 0 if index is None else index
    records = _Records()
    logging.getLogger("tp_allreduce").addHandler(records)
    logging.getLogger("tp_allreduce").setLevel(logging.INFO)
    m = body_imports()
    current_platform = m["current_platform"]
    rec.facts.update(
        vllm=m["vllm"].__version__,
        torch=torch.__version__,
        platform=type(current_platform).__name__,
        local_rank=local_rank,
        gpus=gpus,
        mode=(
            "dry run on CPU (gloo)"
            if dry_run
            else "2 processes on one GPU (MPS), gloo device group, VLLM_DISABLE_PYNCCL=1"
            if shared_gpu
            else "one GPU per process"
        ),
    )

    def platform():
        problems, description = platform_problems(mode)
        raise_if(problems)
        return description

    rec.run("platform_resolution", platform)
    # initialize_model_parallel reads the current vLLM config; vLLM's own
    # tests of this layer set a default one (tests/conftest.py
    # default_vllm_config: set_current_vllm_config(VllmConfig())).
    with m["set_current_vllm_config"](m["VllmConfig"]()):
        setup_and_checks(rec, m, rank, world, port, mode, dry_run, local_rank, shared_gpu, records)
    rec.facts["distributions"] = imported_distributions()
    rec.facts["modules"] = engine_modules()


def setup_and_checks(rec, m, rank, world, port, mode, dry_run, local_rank, shared_gpu, records):
    ps = m["ps"]
    backend = "gloo" if shared_gpu else "nccl"
    rec.running = "setup (init_distributed_environment, initialize_model_parallel)"
    ps.init_distributed_environment(
        world_size=world,
        rank=rank,
        local_rank=local_rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        backend=backend,
        timeout=PEER_TIMEOUT,
    )
    ps.initialize_model_parallel(tensor_model_parallel_size=world, backend=backend)
    rec.running = None
    common.GATHER_GROUP = ps.get_world_group().cpu_group
    tp = ps.get_tp_group()
    comm = tp.device_communicator
    ca = getattr(comm, "ca_comm", None)
    rec.facts.update(
        device=str(tp.device),
        device_communicator=type(comm).__name__,
        ca_comm=type(ca).__name__,
        stubs=stubs_loaded(),
        fi_ar_comm=type(getattr(comm, "fi_ar_comm", None)).__name__,
    )
    if dry_run:
        dry_body(rec, ps, tp, comm, mode, world, records)
    else:
        body(rec, ps, tp, comm, ca, rank, world, mode, shared_gpu)


def dry_body(rec, ps, tp, comm, mode, world, records):
    """CPU: vLLM's tp group with its CudaCommunicator (device cuda:0, never
    used); with the switch on, tp-allreduce's adapter was built into it and
    reported itself disabled on every rank (no GPU), leaving vLLM's own."""
    m = body_imports()

    def communicator():
        problems = []
        if type(comm) is not m["CudaCommunicator"]:
            problems.append(f"tp device communicator is {type(comm).__name__}, not vLLM's CudaCommunicator")
        if str(tp.device) != "cuda:0":
            problems.append(f"tp group device {tp.device}, expected cuda:0 (local rank 0 for every rank)")
        ours = [msg for msg in records.messages if "tp-allreduce disabled for this group" in msg]
        if mode == "off":
            if ours or comm.__dict__.get("_tp_allreduce_done"):
                problems.append("switch off but tp-allreduce's adapter ran")
        else:
            if not comm.__dict__.get("_tp_allreduce_done"):
                problems.append("tp-allreduce's install did not run in CudaCommunicator.__init__")
            if not ours or not all(f"rank {r}:" in ours[0] for r in range(world)):
                problems.append(f"expected tp-allreduce disabled on CPU with every rank's reason; log: {records.messages}")
            if type(comm.ca_comm).__name__.startswith("TpAllreduce"):
                problems.append("a disabled tp-allreduce adapter was left as ca_comm")
        raise_if(problems)
        return f"{type(comm).__name__} on {tp.device}; ca_comm {type(comm.ca_comm).__name__}" + (f"; {ours[0]}" if ours else "")

    rec.run("communicator_on_cpu", communicator)

    def helpers():
        x = fresh((1000,), torch.bfloat16, "cpu")
        ref = reference(x)
        problems = [bitwise_across_ranks(ref.to(torch.bfloat16), "reference")]
        if mismatch(ref + 1.0, ref, torch.bfloat16, "shifted") is None:
            problems.append("mismatch() accepted a result off by 1.0")
        raise_if(problems)
        return "reference and bitwise comparison over the world CPU group"

    rec.run("reference_helpers", helpers)

    def eager_on_cpu():
        """vLLM's dispatch with CPU tensors: CudaCommunicator.all_reduce (its
        torch.distributed fallback: no custom allreduce, no pynccl here; the
        group's all_reduce goes through vLLM's custom op, registered for CUDA
        only); the unguarded custom all-gather / reduce-scatter calls return
        None (vLLM falls back)."""
        dt = torch.bfloat16
        problems = []
        x = fresh((5, 1024), dt, "cpu")
        problems.append(mismatch(comm.all_reduce(x.clone()), reference(x), dt, "CudaCommunicator.all_reduce (cpu)"))
        g = comm.custom_all_gather(fresh((4, 1024), dt, "cpu"))
        r = comm.custom_reduce_scatter(fresh((4 * world, 512), dt, "cpu"))
        if g is not None or r is not None:
            problems.append(f"custom_all_gather / custom_reduce_scatter returned {type(g).__name__} / {type(r).__name__} with no usable custom allreduce")
        raise_if(problems)
        return "CudaCommunicator.all_reduce matches the reference; custom all-gather / reduce-scatter None"

    rec.run("all_reduce_on_cpu", eager_on_cpu)

    def capture_signature():
        """The GPU run's calls of vLLM's graph_capture bind to its signature:
        ``graph_capture(device=...)`` always, ``graph_capture(device,
        stream)`` (graph_capture_shared_stream) where vLLM takes a stream."""
        sig = inspect.signature(ps.graph_capture)
        calls = [((), {"device": tp.device})]
        if "stream" in sig.parameters:
            calls.append(((tp.device, None), {}))
        problems = []
        for args, kwargs in calls:
            try:
                sig.bind(*args, **kwargs)
            except TypeError as e:
                problems.append(f"graph_capture{sig} does not take {args} {kwargs}: {e}")
        raise_if(problems)
        gpu = ["graph_capture_profile_then_real"] + (["graph_capture_shared_stream"] if len(calls) > 1 else [])
        return f"graph_capture{sig}; the GPU run's capture checks: {', '.join(gpu)}"

    rec.run("graph_capture_signature", capture_signature)
    rec.run("destroy", lambda: (ps.destroy_model_parallel(), "destroy_model_parallel() returned")[1])


def body(rec, ps, tp, comm, ca, rank, world, mode, shared_gpu):
    counter = CallCounter(ca.comm) if ca is not None and hasattr(ca, "comm") and ca.comm is not None else None

    def attributes():
        problems = []
        if mode == "off":
            if type(ca).__name__.startswith("TpAllreduce"):
                problems.append("switch off but ca_comm is tp-allreduce's")
            return f"vLLM's own ca_comm: {type(ca).__name__}"
        if counter is None or ca.disabled:
            raise AssertionError(f"ca_comm is {type(ca).__name__}, disabled: {getattr(ca, 'disabled_reason', None)}")
        for attr in ("fully_connected", "mnnvl_lamport_ag_multicast_ptr"):
            if not hasattr(ca, attr):
                problems.append(f"ca_comm has no {attr}")
        if ca.mnnvl_lamport_ag_multicast_ptr != 0:
            problems.append("mnnvl_lamport_ag_multicast_ptr is not 0")
        raise_if(problems)
        return f"fully_connected={ca.fully_connected} mnnvl_lamport_ag_multicast_ptr=0 batch_invariant={ca.batch_invariant}"

    rec.run("ca_comm_attributes", attributes)

    def eager():
        problems, n = [], 0
        before = counter.get("all_reduce") if counter else 0
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            limit = (8 << 20) // torch.empty((), dtype=dtype).element_size()
            for count in (8, 1000, 3 * 7168, limit - 8, limit + 8):
                x = fresh((count,), dtype, device=tp.device)
                y = comm.all_reduce(x)
                torch.cuda.synchronize()
                problems += [mismatch(y, reference(x), dtype, f"{dtype} n={count}"), bitwise_across_ranks(y, f"{dtype} n={count}")]
                n += 1
        rec.calls += n
        ours = (counter.get("all_reduce") - before) if counter else 0
        if mode != "off" and ours == 0:
            problems.append("no call reached tp-allreduce")
        raise_if(problems)
        return f"{n} CudaCommunicator.all_reduce calls, {ours} through tp-allreduce"

    rec.run("cuda_communicator_all_reduce", eager)

    def gather_scatter():
        x = fresh((4, 1024), torch.bfloat16, tp.device)
        g = comm.custom_all_gather(x)
        rs_in = fresh((4 * world, 512), torch.bfloat16, tp.device)
        r = comm.custom_reduce_scatter(rs_in)
        torch.cuda.synchronize()
        problems = []
        if g is not None:
            problems.append(mismatch(g, torch.cat(everyone(x)), torch.bfloat16, "custom_all_gather"))
        if r is not None:
            want = reference(rs_in)[rank * 4 : (rank + 1) * 4]
            problems.append(mismatch(r, want, torch.bfloat16, "custom_reduce_scatter"))
        has = ca is not None and hasattr(getattr(ca, "comm", None), "all_gather")
        if mode != "off" and has and g is None:
            problems.append("Communicator has all_gather but custom_all_gather returned None")
        raise_if(problems)
        return f"custom_all_gather -> {'tensor' if g is not None else 'None (vLLM falls back)'}, custom_reduce_scatter -> {'tensor' if r is not None else 'None (vLLM falls back)'}"

    rec.run("custom_all_gather_reduce_scatter", gather_scatter)

    def capture_sequence():
        """vLLM's profile_cudagraph_memory then capture_model: a profiling
        window into a throwaway pool that is freed, then the real window,
        whose inputs land at the freed addresses."""
        if mode == "off" and shared_gpu:
            raise NotRun(
                "vLLM's own path has no capturable allreduce with two ranks on one GPU "
                "(no pynccl: NCCL refuses them; the gloo fallback cannot be captured)"
            )
        problems = []
        sizes = [32, 8, 3, 1]
        addresses = {}

        def window(pool, label):
            graphs = {}
            with ps.graph_capture(device=tp.device) as ctx:
                for bs in sizes:
                    static = torch.zeros((bs, 4096), dtype=torch.bfloat16, device=tp.device)
                    addresses.setdefault(label, []).append(static.data_ptr())
                    for _ in range(2):
                        static.copy_(fresh(static.shape, torch.bfloat16, tp.device))
                        warm = tp.all_reduce(static)
                        torch.cuda.synchronize()
                        problems.append(mismatch(warm, reference(static), torch.bfloat16, f"{label} warm-up bs={bs}"))
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool, stream=ctx.stream):
                        out = tp.all_reduce(static * 1.0)
                    graphs[bs] = (g, static, out)
            return graphs

        prof_pool = torch.cuda.graph_pool_handle()
        prof = window(prof_pool, "profiling")
        del prof, prof_pool
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        real = window(torch.cuda.graph_pool_handle(), "real")
        reused = len(set(addresses["profiling"]) & set(addresses["real"]))
        for replay in range(3):
            for bs, (g, static, out) in real.items():
                static.copy_(fresh(static.shape, torch.bfloat16, tp.device))
                out.fill_(NAN)
                g.replay()
                torch.cuda.synchronize()
                what = f"replay {replay} bs={bs}"
                problems += [mismatch(out, reference(static), torch.bfloat16, what), bitwise_across_ranks(out, what)]
                rec.calls += 1
                # an eager call between replays, as vLLM's eager paths do
                x = fresh((7, 512), torch.bfloat16, tp.device)
                y = comm.all_reduce(x)
                torch.cuda.synchronize()
                problems.append(mismatch(y, reference(x), torch.bfloat16, f"eager between ({what})"))
                rec.calls += 1
        raise_if(problems)
        return f"profiling window freed, real window: {reused} of {len(sizes)} inputs at reused addresses, 3 replays"

    rec.run("graph_capture_profile_then_real", capture_sequence)

    # vLLM 0.34.0: graph_capture(device, stream=None). Its model runner
    # captures the model's graphs in one window, then the inner graphs in a
    # second window on the same stream and pool (graph_capture(device,
    # stream)), so the second window's captured inputs can land in blocks
    # the first window's graphs freed: registered twice, once per window.
    if "stream" in inspect.signature(ps.graph_capture).parameters:

        def shared_stream():
            if mode == "off" and shared_gpu:
                raise NotRun(
                    "vLLM's own path has no capturable allreduce with two ranks on one GPU "
                    "(no pynccl: NCCL refuses them; the gloo fallback cannot be captured)"
                )
            problems, graphs, inputs = [], [], {}
            pool = torch.cuda.graph_pool_handle()

            def capture(ctx, label, sizes):
                for bs in sizes:
                    static = torch.zeros((bs, 4096), dtype=torch.bfloat16, device=tp.device)
                    static.copy_(fresh(static.shape, torch.bfloat16, tp.device))
                    warm = tp.all_reduce(static)
                    torch.cuda.synchronize()
                    problems.append(mismatch(warm, reference(static), torch.bfloat16, f"{label} warm-up bs={bs}"))
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool, stream=ctx.stream):
                        captured = static * 1.0  # allocated in the pool, freed after the graph
                        inputs.setdefault(label, []).append(captured.data_ptr())
                        out = tp.all_reduce(captured)
                    graphs.append((f"{label} bs={bs}", g, static, out))

            with ps.graph_capture(device=tp.device) as first:
                stream = first.stream
                capture(first, "window 1", [32, 8])
            with ps.graph_capture(tp.device, stream) as second:
                if second.stream is not stream:
                    problems.append("graph_capture(device, stream) did not capture on the stream given")
                capture(second, "window 2", [8, 3])
            reused = len(set(inputs["window 1"]) & set(inputs["window 2"]))
            for replay in range(3):
                for label, g, static, out in graphs:
                    static.copy_(fresh(static.shape, torch.bfloat16, tp.device))
                    out.fill_(NAN)
                    g.replay()
                    torch.cuda.synchronize()
                    what = f"replay {replay} {label}"
                    problems += [mismatch(out, reference(static), torch.bfloat16, what), bitwise_across_ranks(out, what)]
                    rec.calls += 1
            raise_if(problems)
            return (
                f"two graph_capture windows on one stream and pool, {len(graphs)} graphs, "
                f"{reused} of window 2's captured inputs at window 1's addresses, 3 replays of each"
            )

        rec.run("graph_capture_shared_stream", shared_stream)

    if mode == "invariant":

        def invariance():
            problems = []
            rows = fresh((64, 4096), torch.bfloat16, tp.device)
            full = comm.all_reduce(rows)
            for bs in (1, 3, 8, 17, 64):
                part = comm.all_reduce(rows[:bs].contiguous())
                torch.cuda.synchronize()
                if not torch.equal(part, full[:bs]):
                    problems.append(f"batch {bs}: rows differ bitwise from the same rows in a batch of 64")
            plans = sorted({ca.comm.plan(n, torch.bfloat16)[0] for n in (16, 4096, 43008, 1 << 20, 8 << 20, 32 << 20)})
            SIZE_INDEPENDENT_ALGORITHMS = body_imports()["SIZE_INDEPENDENT_ALGORITHMS"]

            if not set(plans) <= set(SIZE_INDEPENDENT_ALGORITHMS):
                problems.append(f"plans {plans} include a size-dependent algorithm")
            rec.facts["invariant_plans"] = plans
            raise_if(problems)
            return f"same bits for batch 1..64; plans {plans}"

        rec.run("batch_invariant", invariance)

    rec.facts["tp_allreduce_calls"] = dict(counter.counts) if counter else {}
    rec.run("destroy", lambda: (ps.destroy_model_parallel(), "destroy_model_parallel() returned")[1])


if __name__ == "__main__":
    main()
