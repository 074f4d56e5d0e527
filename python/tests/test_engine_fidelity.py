"""Static fidelity of the adapters to the pinned engine versions (SGLang
0.5.23, vLLM 0.33.0 and 0.34.0: each vLLM test runs for both), read with ``ast`` from the wheels that
``python/engine_checks/prepare.sh`` builds into .engine-wheels/carry (no
torch needed: nothing of the engines is imported). Without those wheels the
tests skip visibly; the GPU harness (engine_checks/run-on-gpu.sh) runs the
engines' code itself."""

import ast
import glob
import importlib.metadata
import os
import subprocess
import sys
import time
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CARRY = os.path.join(ROOT, ".engine-wheels", "carry")
sys.path.insert(0, os.path.join(ROOT, "python", "engine_checks"))
import prepare  # noqa: E402 (python/engine_checks/prepare.py: stdlib and pip only)

sys.path.pop(0)


def wheel(name, version="*"):
    found = sorted(glob.glob(os.path.join(CARRY, f"{name}-{version}-*.whl")))
    if not found:
        pytest.skip(f"no {name} {version} wheel in {CARRY}: run bash python/engine_checks/prepare.sh")
    return zipfile.ZipFile(found[-1])


VLLM_VERSIONS = [v for name, v in prepare.read_pins()["engines"] if name == "vllm"]


@pytest.fixture(params=VLLM_VERSIONS)
def vllm(request):
    """The carried vLLM wheel of each pinned version."""
    return wheel("vllm", request.param)


def tree(z, path):
    return ast.parse(z.read(path).decode(), filename=path)


def functions(t):
    return {n.name: n for n in ast.walk(t) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def classes(t):
    return {n.name: n for n in ast.walk(t) if isinstance(n, ast.ClassDef)}


def params(fn):
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]


def attr_reads(node, base):
    """Names read as ``base.X`` inside ``node``."""
    return {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == base
    } | {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == base
    }


# ---------------------------------------------------------------- SGLang
def test_sglang_dispatch_and_group_coordinator_calls():
    z = wheel("sglang")
    car = tree(z, "sglang/srt/distributed/device_communicators/custom_all_reduce.py")
    assert params(functions(car)["dispatch_custom_allreduce"]) == ["group", "device"]
    ps = tree(z, "sglang/srt/distributed/parallel_state.py")
    gc = classes(ps)["GroupCoordinator"]
    init = [f for f in gc.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"][0]
    assert "use_mscclpp" in params(init) and "use_pymscclpp" not in params(init)
    src = ast.unparse(gc)
    assert "dispatch_custom_allreduce(group=self.cpu_group, device=self.device)" in src.replace("\n", "").replace("    ", "")
    for name in ("should_custom_ar", "custom_all_reduce", "capture", "disabled"):
        assert name in attr_reads(gc, "ca_comm"), name
    # the fused hook is ROCm-only; the CUDA layer norm calls FlashInfer's entry
    layernorm = ast.unparse(tree(z, "sglang/srt/layers/layernorm.py"))
    assert "flashinfer_allreduce_residual_rmsnorm(" in layernorm
    assert "from sglang.srt.layers.flashinfer_comm_fusion import" in layernorm
    # all-gather through ca_comm only on HIP (hence our patch of the call site)
    ag = [f for f in gc.body if isinstance(f, ast.FunctionDef) and f.name == "_all_gather_into_tensor"][0]
    assert "is_hip()" in ast.unparse(ag) and {"should_custom_ag", "all_gather_unreg"} <= attr_reads(ag, "ca_comm")
    assert "_deterministic_collectives_enabled" in {f.name for f in gc.body if isinstance(f, ast.FunctionDef)}


def test_sglang_fusion_entry_and_gate_match_the_patch():
    from tp_allreduce.integrations import sglang as ours

    z = wheel("sglang")
    fusion = functions(tree(z, "sglang/srt/layers/flashinfer_comm_fusion.py"))
    entry = fusion["flashinfer_allreduce_residual_rmsnorm"]
    assert params(entry) == [
        "input_tensor", "residual", "weight", "eps", "max_token_num", "use_oneshot",
        "trigger_completion_at_end", "fp32_acc", "use_attn_tp_group",
    ]
    assert params(fusion["resolve_fusion_group"]) == ["use_attn_tp_group"]
    add_norm = tree(z, "sglang/srt/layers/layer_boundary/residual/add_norm.py")
    assert params(functions(add_norm)["flashinfer_ar_fusion_applies"]) == ["batch_size"]
    assert f"FUSE_ALLREDUCE_MAX_BATCH_SIZE = {ours.FUSION_MAX_TOKENS}" in ast.unparse(add_norm)
    for user in ("exit.py", "fusions/allreduce.py"):  # import it by name after add_norm ran
        src = ast.unparse(tree(z, f"sglang/srt/layers/layer_boundary/{user}"))
        assert "flashinfer_ar_fusion_applies" in src
    # the fallback relies on a fresh residual (flashinfer_preserves_residual)
    assert "flashinfer_preserves_residual" in ast.unparse(tree(z, "sglang/srt/layers/layer_boundary/fusions/allreduce.py"))


def test_sglang_v2_is_what_the_dispatcher_names():
    z = wheel("sglang")
    v2 = classes(tree(z, "sglang/srt/distributed/device_communicators/custom_all_reduce_v2.py"))["CustomAllReduceV2"]
    methods = {f.name for f in v2.body if isinstance(f, ast.FunctionDef)}
    assert {"should_custom_ar", "custom_all_reduce", "capture", "close"} <= methods


# ---------------------------------------------------------------- vLLM
def test_vllm_cuda_communicator_calls_and_attributes(vllm):
    z = vllm
    cc = classes(tree(z, "vllm/distributed/device_communicators/cuda_communicator.py"))["CudaCommunicator"]
    fns = {f.name: f for f in cc.body if isinstance(f, ast.FunctionDef)}
    assert {"cpu_group", "device", "device_group", "unique_name", "use_all2all"} <= set(params(fns["__init__"]))
    for name in ("custom_all_gather", "custom_reduce_scatter"):
        assert name in attr_reads(fns[name], "ca_comm"), name  # called without a hasattr guard
    order = ast.unparse(fns["all_reduce"])
    assert order.index("fi_ar_comm.all_reduce") < order.index("ca_comm.custom_all_reduce"), "FlashInfer before ca_comm"
    assert {"use_custom_allreduce", "fi_ar_comm", "fi_pcie_ipc_ar_comm", "use_flashinfer_allreduce"} <= attr_reads(fns["__init__"], "self")
    assert "destroy" in fns


def test_vllm_callers_fall_back_on_none_and_read_the_attributes_we_set(vllm):
    z = vllm
    sp = ast.unparse(tree(z, "vllm/models/common/ops/sequence_parallel.py"))
    assert "if output is not None:" in sp and "tensor_model_parallel_all_gather" in sp
    logits = ast.unparse(tree(z, "vllm/models/deepseek_v41/nvidia/specialized_decode/logits/logits.py"))
    if "custom_all_gather(" in logits:  # 0.33.0 (0.34.0 gathers with the executor's all-gather)
        assert "if gathered is not None:" in logits
    assert "ca_comm.fully_connected" in ast.unparse(tree(z, "vllm/models/deepseek_v41/nvidia/model.py"))
    assert "comm.mnnvl_lamport_ag_multicast_ptr" in ast.unparse(tree(z, "vllm/models/deepseek_v41/nvidia/ops/mhc.py"))
    car = ast.unparse(tree(z, "vllm/distributed/device_communicators/custom_all_reduce.py"))
    assert "self.mnnvl_lamport_ag_multicast_ptr = 0" in car  # vLLM's value without the feature
    assert "fully_connected = current_platform.is_fully_connected(physical_device_ids)" in car


def test_vllm_graph_capture_reaches_our_capture_on_the_stream_given(vllm):
    """vLLM's graph_capture(device[, stream]) enters ca_comm.capture() (our
    registration) through the tp GroupCoordinator; 0.34.0's stream
    parameter is reused as the capture stream and its model runner passes
    the first window's stream to a second window (vllm_check's
    graph_capture_shared_stream runs that sequence on the GPU)."""
    z = vllm
    ps = tree(z, "vllm/distributed/parallel_state.py")
    gc = next(f for f in ps.body if isinstance(f, ast.FunctionDef) and f.name == "graph_capture")  # the module's
    assert params(gc)[0] == "device"
    assert "maybe_ca_context = ca_comm.capture()" in ast.unparse(ps)
    if "stream" in params(gc):
        assert "GraphCaptureContext(stream or torch.cuda.Stream(device=device))" in ast.unparse(gc)
        runner = ast.unparse(tree(z, "vllm/v1/worker/gpu/cudagraph_utils.py"))
        assert "graph_capture(self.device, stream)" in runner
        assert "self.capture_stream = context.stream" in runner


def test_vllm_mnnvl_only_gate_is_inside_vllms_own_class(vllm):
    """vLLM's own CustomAllreduce sets mnnvl_only on a group spanning nodes
    (0.34.0 also gates its IPC allreduce and graph registration on it); no
    carried module reads it from ca_comm. tp-allreduce never replaces that
    ca_comm: on a group spanning hosts it disables itself and vLLM's stays
    (test_adapters_vllm: a group across hosts keeps vLLM's own)."""
    z = vllm
    car = classes(tree(z, "vllm/distributed/device_communicators/custom_all_reduce.py"))["CustomAllreduce"]
    assert "self.mnnvl_only = not same_node" in ast.unparse(car)
    for path in z.namelist():
        if path.endswith(".py") and path != "vllm/distributed/device_communicators/custom_all_reduce.py":
            assert "mnnvl_only" not in z.read(path).decode("utf-8", "replace"), path


def test_vllm_stateless_coordinator_asserts_the_class_we_keep(vllm):
    z = vllm
    src = ast.unparse(tree(z, "vllm/distributed/stateless_coordinator.py"))
    assert "assert device_comm_cls == CudaCommunicator" in src
    assert "self.device_communicator = CudaCommunicator(" in src


def test_vllm_platform_hooks_we_override_exist(vllm):
    z = vllm
    interface = classes(tree(z, "vllm/platforms/interface.py"))["Platform"]
    methods = {f.name for f in interface.body if isinstance(f, ast.FunctionDef)}
    assert {"get_device_communicator_cls", "check_and_update_config"} <= methods
    assert "load_general_plugins" in ast.unparse(tree(z, "vllm/v1/worker/worker_base.py"))
    assert "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY" in ast.unparse(tree(z, "vllm/ray/ray_env.py"))
    assert "fuse_allreduce_rms" in ast.unparse(tree(z, "vllm/config/vllm.py"))
    plugins = ast.unparse(tree(z, "vllm/plugins/__init__.py"))
    assert "entry_points" in plugins


# ---------------------------------------------------------------- activation
def test_installed_wheel_registers_the_vllm_entry_point_and_the_pth():
    import site

    try:
        dist = importlib.metadata.distribution("tp-allreduce")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("tp-allreduce is not pip-installed here (running from the source tree)")
    eps = {(e.group, e.name): e.value for e in dist.entry_points}
    assert eps == {
        ("vllm.general_plugins", "tp_allreduce"): "_tp_allreduce_boot:vllm_plugin",
        ("sglang.srt.plugins", "tp_allreduce"): "_tp_allreduce_boot:sglang_plugin",
    }
    files = [str(f) for f in dist.files or []]
    assert "tp_allreduce_sglang.pth" in files
    assert any(os.path.exists(os.path.join(d, "tp_allreduce_sglang.pth")) for d in site.getsitepackages())


# ---------------------------------------------------------------- prepare.py and the launcher
def _wheel(folder, name, version, requires=(), files=None):
    """A minimal wheel (METADATA with Requires-Dist) for prepare's checks."""
    path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta + "\n")
        for n, text in (files or {}).items():
            z.writestr(n, text)
    return path


def test_prepare_flags_a_carried_wheel_that_misses_its_engines_pin(tmp_path):
    engine = _wheel(tmp_path, "engine", "1.0", ["openai>=2.25.0", "xgrammar==0.2.8; platform_machine == 'x86_64'", "absent"])
    old = _wheel(tmp_path, "openai", "2.8.0", ["jiter<1"])
    jiter = _wheel(tmp_path, "jiter", "0.19.0")
    xg = _wheel(tmp_path, "xgrammar", "0.2.7")
    bad, _ = prepare.check_install_set("engine", [engine, old, jiter, xg], "3.12", {})
    assert any("openai>=2.25.0" in b and "2.8.0" in b for b in bad), bad
    assert any("xgrammar==0.2.8" in b for b in bad), bad
    assert len(bad) == 2, bad  # jiter 0.19.0 meets openai's <1; "absent" is only reported
    new = _wheel(tmp_path, "openai", "2.25.0", ["jiter<0.10"])
    xg8 = _wheel(tmp_path, "xgrammar", "0.2.8")
    bad, report = prepare.check_install_set("engine", [engine, new, jiter, xg8], "3.12", {})
    assert bad == [f"openai 2.25.0 requires jiter<0.10; carried for engine: jiter 0.19.0"], bad
    assert any("absent" in line for line in report)


def test_prepare_evaluates_markers_and_extras_for_the_gpu_machine(tmp_path):
    engine = _wheel(tmp_path, "engine", "1.0", ["web[std]<1", "six==1; python_version < '3.12'"])
    web = _wheel(tmp_path, "web", "0.5", ["six>=2; extra == 'std'"])
    six = _wheel(tmp_path, "six", "1")
    bad, _ = prepare.check_install_set("engine", [engine, web, six], "3.12", {})
    assert bad == ["web 0.5[std] requires six>=2; extra == \"std\"; carried for engine: six 1"], bad
    bad, _ = prepare.check_install_set("engine", [engine, web, six], "3.11", {"numpy": "2.0"})
    assert len(bad) == 1, bad  # 3.11: six==1 met as well, the extra still not


def test_prepare_closure_skips_what_only_type_checking_imports(tmp_path):
    path = _wheel(
        tmp_path,
        "pkg",
        "1",
        files={
            "pkg/__init__.py": "from typing import TYPE_CHECKING\nimport pkg.a\nif TYPE_CHECKING:\n    import pkg.b\nelse:\n    import pkg.c\n",
            "pkg/a.py": "def f():\n    import pkg.d\n",
            "pkg/b.py": "",
            "pkg/c.py": "",
            "pkg/d.py": "",
        },
    )
    files = prepare.closure(zipfile.ZipFile(path), "pkg", ["pkg"])
    assert files == {"pkg/__init__.py", "pkg/a.py", "pkg/c.py"}, files


def test_prepare_wheel_tags_for_the_target_python():
    assert prepare._fits("x-1-cp312-cp312-manylinux_2_28_x86_64.whl", "3.12")
    assert not prepare._fits("x-1-cp312-cp312-manylinux_2_28_x86_64.whl", "3.11")
    assert prepare._fits("x-1-cp38-abi3-manylinux_2_28_x86_64.whl", "3.11")
    assert not prepare._fits("x-1-cp312-abi3-manylinux_2_28_x86_64.whl", "3.11")
    assert prepare._fits("x-1-py3-none-any.whl", "3.12")


def test_carried_venvs_meet_their_engines_requirements():
    lists = sorted(glob.glob(os.path.join(CARRY, "*.install")))
    if not lists:
        pytest.skip(f"no <engine>.install in {CARRY}: run bash python/engine_checks/prepare.sh")
    want = sorted(f"{venv}.install" for venv, _, _ in prepare.venvs(prepare.read_pins()))
    assert sorted(os.path.basename(p) for p in lists) == want
    image = prepare.read_image_list()
    for path in lists:
        engine = os.path.basename(path).split(".install")[0].split("-")[0]
        wheels = [os.path.join(CARRY, line.strip()) for line in open(path) if line.strip()]
        bad, _ = prepare.check_install_set(engine, wheels, prepare.PYTHON_VERSION, image)
        assert bad == [], bad
        names = {os.path.basename(w).split("-")[0] for w in wheels}
        assert engine in names and "openai" in names


def _run_checks():
    sys.path.insert(0, os.path.join(ROOT, "python"))
    try:
        from engine_checks import run_checks
    finally:
        sys.path.pop(0)
    return run_checks


def test_pins_give_each_vllm_version_its_venv_and_seeds():
    assert prepare.venvs(prepare.read_pins()) == [
        ("sglang", "sglang", "0.5.23"),
        ("vllm-0.33.0", "vllm", "0.33.0"),
        ("vllm-0.34.0", "vllm", "0.34.0"),
    ]
    assert os.path.basename(prepare.seeds_file("vllm-0.33.0", "vllm")) == "vllm-seeds.txt"
    assert os.path.basename(prepare.seeds_file("vllm-0.34.0", "vllm")) == "vllm-0.34.0-seeds.txt"
    assert os.path.basename(prepare.seeds_file("sglang", "sglang")) == "sglang-seeds.txt"


def test_every_vllm_venv_gets_the_three_runs_and_its_version_checked():
    rc = _run_checks()
    runs = rc.runs(["sglang", "vllm-0.33.0", "vllm-0.34.0"])
    assert [r[0] for r in runs] == [
        "sglang",
        "vllm-0.33.0-on", "vllm-0.33.0-off", "vllm-0.33.0-invariant",
        "vllm-0.34.0-on", "vllm-0.34.0-off", "vllm-0.34.0-invariant",
    ]
    for name, venv, _, _, env, _ in runs[1:]:
        assert env[rc.EXPECT_VERSION] == venv.split("-", 1)[1], name
    assert rc.EXPECT_VERSION not in rc.runs(["vllm"])[0][4], "an unversioned venv expects no version"
    assert sum(r[5] for r in runs) == 510


def test_launcher_stops_the_other_rank_when_one_fails(tmp_path):
    """run_checks.supervise: a rank exiting with an error ends the run in
    seconds (the other gets SIGUSR1, its stack dump, then SIGKILL)."""
    run_checks = _run_checks()
    code = "import faulthandler, signal, time\nfaulthandler.register(signal.SIGUSR1)\ndef waiting_for_peer():\n    time.sleep(120)\nwaiting_for_peer()\n"
    crashed = run_checks.start([sys.executable, "-c", "import sys, time; time.sleep(0.5); sys.exit(1)"], dict(os.environ), str(tmp_path / "a.log"))
    waiting = run_checks.start([sys.executable, "-c", code], dict(os.environ), str(tmp_path / "b.log"))
    t = time.monotonic()
    timed_out, first = run_checks.supervise([crashed, waiting], 60, ["rank 0", "rank 1"])
    assert (timed_out, first) == (False, "rank 0")
    assert time.monotonic() - t < 15
    assert waiting.returncode not in (None, 0)
    assert "waiting_for_peer" in (tmp_path / "b.log").read_text()
    hung = run_checks.start([sys.executable, "-c", "import time; time.sleep(120)"], dict(os.environ), str(tmp_path / "c.log"))
    assert run_checks.supervise([hung], 1, ["rank 0"]) == (True, None)
    assert hung.returncode not in (None, 0)
