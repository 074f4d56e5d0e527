"""torch.compile(fullgraph=True) over a layer that calls tp-allreduce's
entry points through an engine adapter: the allreduce, the fused
allreduce + residual + RMSNorm, the all-gather and the reduce-scatter.

``fullgraph_meta()`` (the dry run's SGLang ranks, CPU, no CUDA stood in): on meta tensors, over a
communicator whose native core raises if touched, so only the custom ops'
fake implementations can run; a graph break (a pyo3 call, ``data_ptr()``)
fails ``fullgraph=True``.
"""


def fullgraph_meta():
    import torch

    from engine_checks.common import raise_if
    from tp_allreduce.integrations._adapter import CustomAllreduceAdapter, TorchRuntime
    from tp_allreduce.torch import Communicator

    class Core:
        """Stands for the native communicator: the meta path must never call it."""

        rank, world_size = 0, 2

        def close(self):
            pass

        def __getattr__(self, name):
            raise AssertionError(f"the native communicator's {name} was reached while tracing or on meta tensors")

    meta = torch.device("meta")
    comm = Communicator(Core(), meta)

    class Runtime(TorchRuntime):
        def rank_and_world(self, group):
            return 0, 2

        def gather_object(self, group, obj):
            return [obj, obj]

        def hostname(self):
            return "this-host"

        def normalize_device(self, device):
            return device

        def make_communicator(self, group, device, capture_copy_bytes, size_independent=False):
            return comm

    ca = CustomAllreduceAdapter(group=None, device=meta, runtime=Runtime())
    raise_if([] if not ca.disabled else [f"adapter disabled: {ca.disabled_reason}"])
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(x, residual, weight):
        y = ca.custom_all_reduce(x)
        normed, residual = ca.fused_allreduce_rmsnorm(y * 2.0, residual, weight, 1e-6)
        gathered = comm.all_gather(normed)
        return comm.reduce_scatter(gathered + 1.0), residual

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    rows, hidden = 4, 64
    x = torch.empty(rows, hidden, dtype=torch.bfloat16, device=meta)
    residual = torch.empty_like(x)
    weight = torch.empty(hidden, dtype=torch.bfloat16, device=meta)
    out, res = compiled(x, residual, weight)
    problems = []
    if (tuple(out.shape), out.dtype, out.device.type) != ((rows, hidden), torch.bfloat16, "meta"):
        problems.append(f"output {tuple(out.shape)} {out.dtype} {out.device}")
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    ours = sorted({t for t in targets if t.startswith("tp_allreduce.")})
    want = ["tp_allreduce.all_gather", "tp_allreduce.all_reduce", "tp_allreduce.all_reduce_add_rms_norm", "tp_allreduce.reduce_scatter"]
    if len(graphs) != 1 or ours != want:
        problems.append(f"{len(graphs)} graph(s); tp_allreduce ops in them {ours}, expected {want}")
    if (ca.counters["ours"], ca.counters["fused"]) != (1, 1):
        problems.append(f"adapter counters after one compiled call: {ca.counters}")
    ca.close()
    raise_if(problems)
    return f"one graph, no break; ops {', '.join(t.split('.')[1] for t in ours)}; counters {ca.counters}"
