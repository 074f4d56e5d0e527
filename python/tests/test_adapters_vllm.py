"""The vLLM general plugin without vLLM: the enable switch, the entry
point, Ray forwarding, and the install into fake vLLM classes."""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
from _fakes import FakeGroup, FakeRuntime, run_ranks
from _gate import require
from tp_allreduce.integrations import vllm as plugin
from tp_allreduce.integrations.vllm._classes import (
    TpAllreduceVllmCustomAllreduce,
    install_platform,
    make_communicator_class,
)


def test_entry_point_is_a_general_plugin_and_no_platform_plugin():
    eps = importlib.metadata.entry_points()

    def group(name):
        return list(eps.select(group=name)) if hasattr(eps, "select") else list(eps.get(name, []))

    ours = [ep for ep in group("vllm.general_plugins") if ep.name == "tp_allreduce"]
    require(bool(ours), "package metadata not installed (running from the source tree)")
    assert ours[0].value == "_tp_allreduce_boot:vllm_plugin"
    assert not [ep for ep in group("vllm.platform_plugins") if ep.value.startswith("tp_allreduce")]


def test_ray_forwarding_adds_our_prefix_once(monkeypatch):
    monkeypatch.setenv(plugin.RAY_PREFIXES, "LMCACHE_, OTHER_")
    plugin.forward_to_ray()
    plugin.forward_to_ray()
    assert os.environ[plugin.RAY_PREFIXES] == "LMCACHE_,OTHER_,TP_ALLREDUCE_"
    monkeypatch.delenv(plugin.RAY_PREFIXES)
    plugin.forward_to_ray()
    assert os.environ[plugin.RAY_PREFIXES] == "TP_ALLREDUCE_"


FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/device_communicators/__init__.py": "",
    "vllm/distributed/device_communicators/cuda_communicator.py": "class CudaCommunicator:\n    def __init__(self):\n        pass\n",
    "vllm/platforms/__init__.py": "",
    "vllm/platforms/cuda.py": textwrap.dedent(
        """
        class CudaPlatform:
            @classmethod
            def check_and_update_config(cls, vllm_config):
                vllm_config.seen = True
        """
    ),
}

PROBE = textwrap.dedent(
    """
    import os, _tp_allreduce_boot
    _tp_allreduce_boot.vllm_plugin()  # what vLLM's load_general_plugins() calls
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    from vllm.platforms.cuda import CudaPlatform
    print(bool(CudaCommunicator.__dict__.get("_tp_allreduce_installed")),
          bool(CudaPlatform.__dict__.get("_tp_allreduce_platform")),
          "TP_ALLREDUCE_" in os.environ.get("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", ""))
    """
)


@pytest.mark.parametrize("switch, want", [(None, "False False False"), ("0", "False False False"), ("1", "True True True")])
def test_general_plugin_installs_when_vllm_imports_its_classes(tmp_path, switch, want):
    for rel, text in FAKE_VLLM.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    require(importlib.util.find_spec("_tp_allreduce_boot") is not None, "the wheel is not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TP_ALLREDUCE_", "VLLM_"))}
    env["PYTHONPATH"] = str(tmp_path)
    if switch is not None:
        env["TP_ALLREDUCE_VLLM"] = switch
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == want
    assert r.stderr == "", "no warning when it works"


def test_platform_hook_turns_fusion_off_only_over_flashinfer(monkeypatch):
    class Pass:
        fuse_allreduce_rms = True

    class Config:
        class compilation_config:
            pass_config = None

    class FakeCudaPlatform:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            vllm_config.seen = cls

    class Child(FakeCudaPlatform):
        pass

    install_platform(FakeCudaPlatform)
    install_platform(FakeCudaPlatform)  # idempotent
    for switch, fused in (("0", True), ("1", False)):
        monkeypatch.setenv("TP_ALLREDUCE_VLLM_OVER_FLASHINFER", switch)
        cfg = Config()
        cfg.compilation_config = type("C", (), {"pass_config": Pass()})()
        Child.check_and_update_config(cfg)
        assert cfg.seen is Child, "vLLM's own method ran, bound to the subclass"
        assert cfg.compilation_config.pass_config.fuse_allreduce_rms is fused


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


def build_communicators(world, unique_name, fail_rank=None, hosts=None):
    group = FakeGroup(world)

    def body(rank):
        def runtime(g):
            fail = RuntimeError("IPC refused") if rank == fail_rank else None
            return FakeRuntime(rank, g, fail=fail, host=(hosts or {}).get(rank, "host-a"))

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


def test_vllm_gates_decline_the_sizes_whose_plan_is_nccl():
    """vLLM asks `should_custom_ar`, `should_custom_all_gather` and
    `should_custom_reduce_scatter` before each call: where the
    communicator's plan is NCCL's (here: 64 KiB and more, a block a rank for
    the collectives), each says no and vLLM's own path runs."""
    from _fakes import FakeTensor

    group = FakeGroup(2)
    large = 64 * 1024

    def body(rank):
        rt = FakeRuntime(rank, group, nccl_rule=lambda what, nbytes, capturing: nbytes >= large)
        ca = TpAllreduceVllmCustomAllreduce(group, f"cuda:{rank}", runtime=rt)
        ca.comm.all_gather = ca.comm.reduce_scatter = lambda t: t
        dev = f"cuda:{rank}"
        got = [
            ca.should_custom_ar(FakeTensor([1.0] * 1024, "bfloat16", dev)),
            ca.should_custom_ar(FakeTensor([1.0] * (large // 2), "bfloat16", dev)),
            ca.should_custom_all_gather(FakeTensor([1.0] * 1024, "bfloat16", dev)),
            ca.should_custom_all_gather(FakeTensor([1.0] * (large // 2), "bfloat16", dev)),
            ca.should_custom_reduce_scatter(FakeTensor([1.0] * 1024, "bfloat16", dev)),
            ca.should_custom_reduce_scatter(FakeTensor([1.0] * large, "bfloat16", dev)),
        ]
        ca.close()
        return got

    for got in run_ranks(2, body):
        assert got == [True, False, True, False, True, False]


def test_a_group_across_hosts_keeps_vllms_own_custom_allreduce():
    """vLLM's own class stays, open, where the group spans hosts: vLLM
    0.34.0 keeps it there as ``mnnvl_only`` (its MNNVL all-gather and
    reduce-scatter, no IPC allreduce); tp-allreduce works within one host."""
    for c in build_communicators(2, "tp:0", hosts={1: "host-b"}):
        assert c.ca_comm is c.vllms_own and not c.ca_comm.closed
