"""The vLLM platform plugin without vLLM: the enable switch, the entry
point, and the classes built on fake vLLM bases."""

import importlib.metadata
import importlib.util

import pytest
from _fakes import FakeGroup, FakeRuntime, run_ranks
from _gate import require
from tp_allreduce.integrations import vllm as plugin
from tp_allreduce.integrations.vllm._classes import (
    TpAllreduceVllmCustomAllreduce,
    make_communicator_class,
    make_platform_class,
)


@pytest.mark.parametrize("value, active", [(None, False), ("", False), ("0", False), ("true", False), ("1", True)])
def test_register_is_inactive_unless_the_switch_is_1(monkeypatch, value, active):
    if value is None:
        monkeypatch.delenv("TP_ALLREDUCE_VLLM", raising=False)
    else:
        monkeypatch.setenv("TP_ALLREDUCE_VLLM", value)
    assert plugin.register() == (plugin.PLATFORM_QUALNAME if active else None)


def test_qualified_names_point_at_modules_of_the_package():
    for qualname in (plugin.PLATFORM_QUALNAME, plugin.COMMUNICATOR_QUALNAME):
        module, _, name = qualname.rpartition(".")
        assert importlib.util.find_spec(module) is not None, module  # found, not imported (needs vLLM)
        assert name in ("TpAllreduceCudaPlatform", "TpAllreduceCudaCommunicator")


def test_entry_point_is_registered_in_the_vllm_group():
    eps = importlib.metadata.entry_points()
    group = (
        eps.select(group="vllm.platform_plugins") if hasattr(eps, "select") else eps.get("vllm.platform_plugins", [])
    )
    ours = [ep for ep in group if ep.value == "tp_allreduce.integrations.vllm:register"]
    require(bool(ours), "package metadata not installed (running from the source tree)")
    assert ours[0].load() is plugin.register


class FakeCudaCommunicator:
    """Stands in for vLLM's CudaCommunicator: builds its own ca_comm."""

    def __init__(self, cpu_group, device=None, device_group=None, unique_name=""):
        self.cpu_group = cpu_group
        self.device = device
        self.unique_name = unique_name
        self.world_size = cpu_group.world
        self.use_custom_allreduce = "tp" in unique_name
        self.ca_comm = VllmOwnCustomAllreduce() if self.use_custom_allreduce else None
        self.vllms_own = self.ca_comm  # what vLLM built, kept for the tests
        self.destroyed = False

    def destroy(self):
        self.destroyed = True


class VllmOwnCustomAllreduce:
    def __init__(self):
        self.closed = False
        self.disabled = False

    def close(self):
        self.closed = True


def adapter_with(rank_runtime):
    class Adapter(TpAllreduceVllmCustomAllreduce):
        def __init__(self, group, device, **kw):
            super().__init__(group, device, runtime=rank_runtime(group), **kw)

    return Adapter


def build_communicators(world, unique_name, fail_rank=None):
    group = FakeGroup(world)

    def body(rank):
        def runtime(g):
            fail = RuntimeError("IPC refused") if rank == fail_rank else None
            return FakeRuntime(rank, g, fail=fail)

        cls = make_communicator_class(FakeCudaCommunicator, adapter_cls=adapter_with(runtime))
        return cls(group, device=f"cuda:{rank}", unique_name=unique_name)

    return run_ranks(world, body)


def test_tp_group_gets_tp_allreduce_and_vllms_own_is_closed():
    for c in build_communicators(2, "tp:0"):
        assert isinstance(c.ca_comm, TpAllreduceVllmCustomAllreduce)
        assert not c.ca_comm.disabled
        assert isinstance(c.vllms_own, VllmOwnCustomAllreduce) and c.vllms_own is not c.ca_comm
        assert c.vllms_own.closed, "vLLM's own custom allreduce (its IPC buffers) is closed once ours replaces it"
        assert c.ca_comm.finalize_p2p() is None
        c.destroy()
        assert c.destroyed and c.ca_comm.disabled, "destroy closes ours and runs vLLM's"


def test_groups_without_custom_allreduce_are_left_alone():
    for c in build_communicators(2, "ep:0"):
        assert c.ca_comm is None


def test_failure_keeps_vllms_own_custom_allreduce():
    for c in build_communicators(2, "tp:0", fail_rank=0):
        assert c.ca_comm is c.vllms_own and isinstance(c.ca_comm, VllmOwnCustomAllreduce) and not c.ca_comm.closed


def test_platform_names_the_tp_allreduce_communicator():
    class FakeCudaPlatform:
        device_name = "cuda"

        @classmethod
        def get_device_communicator_cls(cls):
            return "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator"

    platform = make_platform_class(FakeCudaPlatform, plugin.COMMUNICATOR_QUALNAME, module="m")
    assert issubclass(platform, FakeCudaPlatform) and platform.device_name == "cuda"
    assert platform.get_device_communicator_cls() == plugin.COMMUNICATOR_QUALNAME
    assert (platform.__module__, platform.__qualname__) == ("m", "TpAllreduceCudaPlatform")
