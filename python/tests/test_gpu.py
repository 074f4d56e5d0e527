"""GPU tests: two processes on two GPUs with a gloo group, once with
PyTorch's default allocator and once with expandable segments (cuMem
memory that CUDA IPC cannot export). Without PyTorch or two GPUs they skip
visibly; with TP_ALLREDUCE_REQUIRE_GPU=1 they fail instead.

Each allocator configuration is one spawned run of `_scenarios.suite`
(shared by the tests below through a module fixture); each test asserts
its own checks of that run on every rank."""

import json
import os

import pytest
from _gate import cuda_device_count, has_module, not_applicable, require

WORLD = 2
CONFIGS = {
    "default-allocator": {},
    "expandable-segments": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
}
# Keep peers off NVLink SHARP/multicast paths (not what PCIe boxes have).
COMMON_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def require_gpus():
    require(has_module("torch"), "PyTorch is not installed")
    require(cuda_device_count() >= WORLD, f"fewer than {WORLD} CUDA devices visible")


@pytest.fixture(scope="module", params=list(CONFIGS))
def run(request):
    require_gpus()
    import _spawn

    results = _spawn.run(WORLD, "suite", {**COMMON_ENV, **CONFIGS[request.param]}, timeout_s=240)
    if os.environ.get("OUT"):  # every check's detail and the facts (plans, copies) for the record
        with open(os.path.join(os.environ["OUT"], f"gpu-suite-{request.param}.json"), "w") as f:
            json.dump(results, f, indent=2)
    for r in results:
        assert "fatal" not in r, f"rank {r['rank']} crashed:\n{r['fatal']}"
    return results


def assert_checks(results, names):
    """Every rank ran each named check and it passed."""
    failures = []
    for r in results:
        for name in names:
            check = r["checks"].get(name)
            if check is None:
                failures.append(f"rank {r['rank']}: {name} did not run")
            elif not check["ok"]:
                failures.append(f"rank {r['rank']}: {name} failed:\n{check['detail']}")
    assert not failures, "\n".join(failures)
    return [r["checks"][n]["detail"] for r in results for n in names]


ALGORITHMS = ["auto", "one-shot-pull", "two-shot-pull", "one-shot-push", "two-shot-push"]


def test_exportability_follows_the_allocator(run):
    assert_checks(run, ["exportability"])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_eager_sums_match_the_f64_reference(run, algorithm):
    assert_checks(run, [f"{algorithm}/init", f"{algorithm}/eager"])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_captured_graphs_replay_correctly(run, algorithm):
    assert_checks(run, [f"{algorithm}/init", f"{algorithm}/graph"])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_fused_allreduce_rmsnorm_matches_the_f64_reference(run, algorithm):
    assert_checks(run, [f"{algorithm}/init", f"{algorithm}/fused"])


def test_torch_compile_fullgraph_equals_eager(run):
    assert_checks(run, ["auto/init", "compiled"])


def test_bad_tensors_raise_clear_errors(run):
    assert_checks(run, ["bad_tensors"])


def test_current_device_is_left_unchanged(run):
    assert_checks(run, ["device_unchanged"])


def test_sglang_adapter_through_sglangs_call_sequence(run):
    assert_checks(run, ["sglang_call_sequence"])


def test_sglang_group_coordinator():
    if not has_module("sglang"):
        not_applicable("sglang is not importable: the adapter is tested through the replayed call sequence instead")
    require_gpus()
    import _spawn

    assert_checks(_spawn.run(WORLD, "sglang_group_coordinator", COMMON_ENV), ["sglang_group_coordinator"])


def test_vllm_general_plugin_installs_into_cuda_communicator(monkeypatch):
    if not has_module("vllm"):
        not_applicable("vllm is not importable: the plugin is tested with fake vLLM bases instead")
    monkeypatch.setenv("TP_ALLREDUCE_VLLM", "1")
    from tp_allreduce.integrations import vllm as plugin

    plugin.load_general_plugin()
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    assert CudaCommunicator.__dict__.get("_tp_allreduce_installed")
