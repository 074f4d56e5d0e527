"""The PyTorch layer where PyTorch is installed but no GPU is needed:
device and dtype handling, argument checks before any call reaches the
core, and the process-group plumbing over a 2-process gloo group. Skips
visibly without PyTorch (fails with TP_ALLREDUCE_REQUIRE_GPU=1)."""

import pytest
import tp_allreduce
from _gate import has_module, not_applicable, require
from tp_allreduce import errors


@pytest.fixture(scope="module")
def torch():
    require(has_module("torch"), "PyTorch is not installed")
    import torch

    return torch


@pytest.fixture(scope="module")
def tpt(torch):
    import tp_allreduce.torch as tpt

    return tpt


def test_devices_normalize_to_indexed_cuda_devices(torch, tpt):
    assert tpt.normalize_device(1) == torch.device("cuda", 1)
    assert tpt.normalize_device("cuda:3") == torch.device("cuda", 3)
    assert tpt.normalize_device(torch.device("cuda", 2)) == torch.device("cuda", 2)
    with pytest.raises(errors.InvalidUsage, match="CUDA devices"):
        tpt.normalize_device("cpu")


def test_torch_dtypes_map_and_others_raise(torch):
    d = tp_allreduce.dtypes
    assert [d.code_of(t) for t in (torch.float32, torch.float16, torch.bfloat16)] == [d.F32, d.F16, d.BF16]
    for t in (torch.float64, torch.int32, torch.bool):
        with pytest.raises(errors.Unsupported, match=str(t)):
            d.code_of(t)


class RecordingCore:
    """Stands in for _core.Communicator: records raw calls."""

    rank, world_size, closed = 0, 2, False

    def __init__(self):
        self.calls = []

    def all_reduce(self, *args):
        self.calls.append(args)


def test_bad_tensors_are_refused_before_the_core_is_called(torch, tpt):
    core = RecordingCore()
    comm = tpt.Communicator(core, torch.device("cuda", 0))
    with pytest.raises(errors.InvalidUsage, match="is on cpu, but this communicator runs on cuda:0"):
        comm.all_reduce(torch.ones(4))
    with pytest.raises(errors.InvalidUsage, match="must be a torch.Tensor"):
        comm.all_reduce([1.0, 2.0])
    # A communicator "on the CPU" lets the remaining checks see CPU tensors.
    comm = tpt.Communicator(core, torch.device("cpu"))
    with pytest.raises(errors.InvalidUsage, match="contiguous"):
        comm.all_reduce(torch.ones(4, 4).t())
    with pytest.raises(errors.Unsupported, match="torch.int64"):
        comm.all_reduce_(torch.ones(4, dtype=torch.int64))
    with pytest.raises(errors.InvalidUsage, match="out must match"):
        comm.all_reduce(torch.ones(4), out=torch.empty(5))
    with pytest.raises(errors.InvalidUsage, match="out must match"):
        comm.all_reduce(torch.ones(4), out=torch.empty(4, dtype=torch.float16))
    assert core.calls == []


def test_bad_fused_tensors_are_refused_before_the_core_is_called(torch, tpt):
    core = RecordingCore()
    comm = tpt.Communicator(core, torch.device("cpu"))
    x = torch.ones(3, 8)
    with pytest.raises(errors.InvalidUsage, match="residual is torch.float16"):
        comm.all_reduce_add_rms_norm(x, torch.ones(3, 8, dtype=torch.float16), torch.ones(8), 1e-6)
    with pytest.raises(errors.InvalidUsage, match="not rows of weight.numel"):
        comm.all_reduce_add_rms_norm(x, torch.ones(3, 8), torch.ones(5), 1e-6)
    with pytest.raises(errors.InvalidUsage, match="residual has 16 elements"):
        comm.all_reduce_add_rms_norm(x, torch.ones(2, 8), torch.ones(8), 1e-6)
    with pytest.raises(errors.InvalidUsage, match="out must match"):
        comm.all_reduce_add_rms_norm(x, torch.ones(3, 8), torch.ones(8), 1e-6, out=torch.empty(5))
    with pytest.raises(errors.InvalidUsage, match="residual must match"):
        comm.all_reduce_add_(x, torch.ones(3, 7))
    assert core.calls == []


def test_process_group_plumbing_without_a_gpu(torch, tmp_path):
    if tp_allreduce.driver_available():
        not_applicable("a CUDA driver is present (this test expects NoDriverError)")
    import _spawn

    results = _spawn.run(2, "cpu_group_paths", {"XDG_RUNTIME_DIR": str(tmp_path)}, timeout_s=120)
    for r in results:
        assert "fatal" not in r, r["fatal"]
        for name in ("gather_object", "from_group_without_driver", "adapter_without_driver"):
            assert r["checks"][name]["ok"], f"rank {r['rank']} {name}:\n{r['checks'][name]['detail']}"


def test_from_group_fails_on_every_rank_at_once_when_one_cannot_set_up(torch):
    """Rank 0 (then rank 1) fails its setup before the rendezvous: every rank
    raises within seconds (not the rendezvous timeout), none joins, rank 0's
    rendezvous directory is removed. The core's per-rank setup is stood in,
    so this runs with or without a GPU."""
    import _spawn

    results = _spawn.run(2, "from_group_failure_paths", {}, timeout_s=120)
    for r in results:
        assert "fatal" not in r, r["fatal"]
        for name in ("rank_0_fails", "rank_1_fails"):
            assert r["checks"][name]["ok"], f"rank {r['rank']} {name}:\n{r['checks'][name]['detail']}"
