"""One rank of the vLLM check (started by run_checks.py): vLLM 0.33.0's own
platform resolution (``vllm.platforms.current_platform``, plugins from the
installed entry points), its tp ``GroupCoordinator`` and ``CudaCommunicator``.

    python -m engine_checks.vllm_check RANK WORLD PORT OUT_DIR MODE

MODE: ``on`` (TP_ALLREDUCE_VLLM=1 in the environment), ``off`` (vLLM's own
path), ``invariant`` (on, VLLM_BATCH_INVARIANT=1).
"""

import sys

import torch
import torch.distributed as dist

from engine_checks.common import (
    NAN,
    CallCounter,
    Recorder,
    bitwise_across_ranks,
    everyone,
    fresh,
    mismatch,
    raise_if,
    reference,
    stubs_loaded,
)


def main():
    rank, world, port, out_dir, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    ngpu = torch.cuda.device_count()
    shared_gpu = ngpu < world
    torch.cuda.set_device(rank % ngpu)
    rec = Recorder(f"vllm-{mode}", rank, out_dir)
    try:
        body(rec, rank, world, port, mode, shared_gpu)
        rec.save()
    except BaseException:
        import traceback

        rec.save(fatal=traceback.format_exc())
        raise


def body(rec, rank, world, port, mode, shared_gpu):
    import vllm
    from vllm.platforms import current_platform
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    from vllm.utils.import_utils import resolve_obj_by_qualname

    backend = "gloo" if shared_gpu else "nccl"
    rec.facts.update(
        vllm=vllm.__version__,
        torch=torch.__version__,
        platform=type(current_platform).__name__,
        mode="2 processes on one GPU (MPS), gloo device group, VLLM_DISABLE_PYNCCL=1" if shared_gpu else "one GPU per process",
    )

    def platform():
        name = type(current_platform).__name__
        cls = resolve_obj_by_qualname(current_platform.get_device_communicator_cls())
        problems = []
        if mode == "off" and name != "CudaPlatform":
            problems.append(f"switch off but the platform is {name}")
        if mode != "off" and name != "TpAllreduceCudaPlatform":
            problems.append(f"switch on but the platform is {name} (entry point not found?)")
        if cls is not CudaCommunicator:
            problems.append(f"device communicator class {cls} is not vLLM's CudaCommunicator")
        raise_if(problems)
        return f"{name}; device_comm_cls == CudaCommunicator: {cls == CudaCommunicator}"

    rec.run("platform_resolution", platform)
    ps.init_distributed_environment(
        world_size=world, rank=rank, local_rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}", backend=backend
    )
    ps.initialize_model_parallel(tensor_model_parallel_size=world, backend=backend)
    tp = ps.get_tp_group()
    comm = tp.device_communicator
    ca = getattr(comm, "ca_comm", None)
    rec.facts.update(ca_comm=type(ca).__name__, stubs=stubs_loaded(), fi_ar_comm=type(getattr(comm, "fi_ar_comm", None)).__name__)
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
                y = comm.all_reduce(fresh((7, 512), torch.bfloat16, tp.device))
                torch.cuda.synchronize()
        raise_if(problems)
        return f"profiling window freed, real window: {reused} of {len(sizes)} inputs at reused addresses, 3 replays"

    rec.run("graph_capture_profile_then_real", capture_sequence)

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
            from tp_allreduce.integrations._adapter import SIZE_INDEPENDENT_ALGORITHMS

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
