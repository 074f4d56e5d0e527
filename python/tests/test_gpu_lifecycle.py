"""GPU tests of the Python layer's lifecycle, two processes (rank r on GPU
r % GPUs: one GPU serves, its two processes time-slice without MPS) with a
gloo group: the creation INFO line and the fallback WARNING reaching
Python's logging, teardown that leaves other Python threads running,
close() raising a failed teardown, from_group failing fast and cleaning up
when rank 0 cannot start, shutdown without close(), and calls on streams
that come and go. Without PyTorch or a GPU they skip visibly; with
TP_ALLREDUCE_REQUIRE_GPU=1 they fail instead."""

import json
import os
import tempfile

from _gate import cuda_device_count, has_module, require

WORLD = 2
# Keep peers off NVLink SHARP/multicast paths (not what PCIe boxes have).
COMMON_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def spawn(scenario, env=None, **kw):
    require(has_module("torch"), "PyTorch is not installed")
    require(cuda_device_count() >= 1, "no CUDA device visible")
    import _spawn

    results = _spawn.run(WORLD, scenario, {**COMMON_ENV, **(env or {})}, timeout_s=kw.pop("timeout_s", 180), **kw)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"gpu-lifecycle-{scenario}.json"), "w") as f:
            json.dump(results, f, indent=2)
    return results


def assert_checks(results, names, ranks=range(WORLD)):
    failures = []
    for r in (results[i] for i in ranks):
        if "fatal" in r:
            failures.append(f"rank {r['rank']} crashed:\n{r['fatal']}")
            continue
        for name in names:
            check = r["checks"].get(name)
            if check is None:
                failures.append(f"rank {r['rank']}: {name} did not run")
            elif not check["ok"]:
                failures.append(f"rank {r['rank']}: {name} failed:\n{check['detail']}")
    assert not failures, "\n".join(failures)


def test_creation_info_line_and_capture_copy_warning_reach_python_logging():
    results = spawn("logging_and_fallbacks", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert_checks(results, ["pull_with_capture_copy", "host_staged_by_configuration"])


def test_teardown_releases_the_gil_while_it_waits_for_peers():
    assert_checks(spawn("teardown_keeps_python_running"), ["drop", "close"], ranks=[1])


def test_close_raises_when_the_teardown_fails():
    results = spawn("close_reports_a_failed_teardown", may_die=(0,))
    assert results[0].get("died") == 0, f"rank 0 was to end its process: {results[0]}"
    assert_checks(results, ["close_raises"], ranks=[1])


def test_from_group_fails_fast_and_removes_the_directory_when_rank_0_cannot_start():
    with tempfile.TemporaryDirectory(prefix="tpar-xdg-") as runtime_dir:
        results = spawn("from_group_rank0_fails_before_joining", {"XDG_RUNTIME_DIR": runtime_dir})
    assert_checks(results, ["fails_fast_and_cleans_up"])


def test_communicators_left_to_interpreter_shutdown_exit_cleanly():
    results = spawn("exit_without_close")
    assert_checks(results, ["kept"])
    assert [r["exitcode"] for r in results] == [0] * WORLD, [r["exitcode"] for r in results]


def test_calls_on_streams_that_come_and_go_match_the_f64_reference():
    assert_checks(
        spawn("stream_churn"),
        ["pooled_temporary_streams", "destroyed_streams", "new_stream_right_after_destroying"],
    )


def test_all_gather_and_reduce_scatter_eager_and_captured():
    assert_checks(spawn("gather_scatter"), ["eager", "captured"])
