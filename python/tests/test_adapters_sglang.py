"""The SGLang adapter's logic with torch-free fakes: SGLang's call sequence
(construction on every rank, eager calls, warm-up inside capture(),
captured calls, registration on exit, close), the all-or-nothing
enablement, and the dispatch patch (directly, through the import hook, the
.pth switch and `python -m tp_allreduce.sglang`)."""

import math
import os
import random
import subprocess
import sys
import textwrap
import types

import pytest
from _fakes import FakeGroup, FakeRuntime, FakeTensor, run_ranks
from _gate import require
from tp_allreduce.integrations import sglang as adapter_module
from tp_allreduce.integrations.sglang import TpAllreduceCustomAllreduce, dispatch_custom_allreduce, patch

MAX = 8192 * 1024


def make(world, per_rank=None):
    """Adapters for `world` thread ranks; per_rank[r] are FakeRuntime options."""
    group = FakeGroup(world)
    per_rank = per_rank or {}

    def body(rank):
        rt = FakeRuntime(rank, group, **per_rank.get(rank, {}))
        return TpAllreduceCustomAllreduce(group=group, device=f"cuda:{rank}", runtime=rt)

    return group, run_ranks(world, body)


def test_construction_enables_every_rank():
    _, cas = make(2)
    for rank, ca in enumerate(cas):
        assert ca.disabled is False and ca.original_disabled is False
        assert (ca.rank, ca.world_size, ca.device) == (rank, 2, f"cuda:{rank}")
        assert ca.max_size == MAX


def fresh_seed():
    """A new seed per run (printed in failures, to reproduce one)."""
    return random.SystemRandom().getrandbits(62)


def rank_values(seed, case, rank, n):
    """Rank `rank`'s input of case `case`: fresh values every run that any
    rank can rebuild, so the float64 reference needs no communication."""
    g = random.Random(seed * 1_000_003 + case * 8191 + rank)
    return [g.uniform(-1.0, 1.0) for _ in range(n)]


def reference_sum(seed, case, world, n):
    """The float64 sum over the ranks (math.fsum: correctly rounded)."""
    columns = zip(*(rank_values(seed, case, r, n) for r in range(world)))
    return [math.fsum(c) for c in columns]


def assert_close(got, want, what, seed):
    assert len(got) == len(want), f"{what}: {len(got)} values, expected {len(want)} (seed {seed})"
    for i, (g, w) in enumerate(zip(got, want)):
        assert not math.isnan(g), f"{what}: NaN at {i} (seed {seed})"
        assert abs(g - w) <= 1e-12 * max(1.0, abs(w)), f"{what}: [{i}] = {g}, expected {w} (seed {seed})"


def test_sglang_call_sequence_gives_correct_sums_in_every_phase():
    """Eager, warm-up inside capture(), a call captured into a graph
    (nothing computed at capture; registration on leaving capture();
    replays read the inputs' values at replay time), close."""
    _, cas = make(2)
    seed, world, n = fresh_seed(), 2, 5

    def body(rank):
        ca = cas[rank]
        comm = ca._runtime.comm
        dev = f"cuda:{rank}"
        x = FakeTensor(rank_values(seed, 0, rank, n), device=dev)
        assert ca.should_custom_ar(x)
        eager = ca.custom_all_reduce(x)
        assert_close(eager.values, reference_sum(seed, 0, world, n), "eager (out of place)", seed)
        assert x.values == rank_values(seed, 0, rank, n), "the input is untouched"
        static = FakeTensor(rank_values(seed, 1, rank, n), device=dev)
        with ca.capture():
            assert ca._IS_CAPTURING
            warm = ca.custom_all_reduce(static)  # warm-up: not inside a graph yet
            assert_close(warm.values, reference_sum(seed, 1, world, n), "warm-up returns the real sum", seed)
            with comm.graph() as graph:  # torch.cuda.graph(g) in SGLang
                captured = ca.custom_all_reduce(static)
            assert captured is not None and all(math.isnan(v) for v in captured.values), "computed at capture"
            assert ("register_graph_buffers",) not in comm.calls, "not before the context exits"
        assert not ca._IS_CAPTURING
        assert comm.calls[-1] == ("register_graph_buffers",), "registered on exit"
        assert comm.unregistered == 0, "every captured input registered"
        for case in (2, 3):  # replays with fresh inputs in the captured tensor
            static.values = rank_values(seed, case, rank, n)
            captured.values = [float("nan")] * n
            graph.replay()
            assert_close(captured.values, reference_sum(seed, case, world, n), f"replay of case {case}", seed)
        ca.close()
        return comm.calls

    calls = run_ranks(2, body)
    assert (
        calls[0]
        == calls[1]
        == [
            ("all_reduce", n),
            ("all_reduce", n),
            ("all_reduce", n),
            ("register_graph_buffers",),
            ("close",),
        ]
    )


@pytest.mark.parametrize(
    "tensor, why",
    [
        (FakeTensor([0.0] * (MAX // 2)), "as large as max_size (bf16)"),
        (FakeTensor([0.0] * 8, dtype="int32"), "unsupported dtype"),
        (FakeTensor([0.0] * 8, contiguous=False), "not contiguous"),
        (FakeTensor([0.0] * 8, device="cuda:1"), "another device"),
    ],
)
def test_gate_refuses_what_tp_allreduce_does_not_take(tensor, why):
    _, cas = make(2)
    ca = cas[0]
    assert not ca.should_custom_ar(tensor), why
    assert ca.custom_all_reduce(tensor) is None, why
    assert ca.should_custom_ar(FakeTensor([0.0] * (MAX // 2 - 1)))


def test_world_size_one_makes_no_communicator():
    group = FakeGroup(1)
    rt = FakeRuntime(0, group)
    ca = TpAllreduceCustomAllreduce(group=group, device="cuda:0", runtime=rt)
    assert ca.disabled and ca.original_disabled and rt.comm is None
    assert ca.custom_all_reduce(FakeTensor([1.0])) is None


def test_a_failure_on_one_rank_disables_every_rank():
    _, cas = make(2, {1: {"fail": RuntimeError("no P2P between GPU 0 and 1")}})
    for ca in cas:
        assert ca.disabled and ca.original_disabled
        assert "rank 1: RuntimeError: no P2P between GPU 0 and 1" in ca.disabled_reason
        assert ca.comm is None
        assert ca.custom_all_reduce(FakeTensor([1.0])) is None
    assert cas[0]._runtime.comm.closed, "the rank that succeeded closed its communicator"


def test_a_group_across_hosts_is_disabled_everywhere():
    _, cas = make(2, {1: {"host": "host-b"}})
    for ca in cas:
        assert ca.disabled and "spans hosts" in ca.disabled_reason
        assert ca._runtime.comm is None, "no communicator is even attempted"


def test_unreadable_group_disables_without_raising():
    class Broken(FakeRuntime):
        def rank_and_world(self, group):
            raise RuntimeError("default process group not initialized")

    ca = TpAllreduceCustomAllreduce(group=None, device="cuda:0", runtime=Broken(0, FakeGroup(1)))
    assert ca.disabled and "default process group not initialized" in ca.disabled_reason


def test_exception_inside_capture_skips_registration():
    _, cas = make(2)

    def body(rank):
        ca = cas[rank]
        with pytest.raises(KeyError):
            with ca.capture():
                ca.custom_all_reduce(FakeTensor([1.0], device=f"cuda:{rank}"))
                raise KeyError("capture failed")
        assert not ca._IS_CAPTURING
        return ca._runtime.comm.calls

    for calls in run_ranks(2, body):
        assert ("register_graph_buffers",) not in calls


def test_toggling_disabled_bypasses_calls_but_capture_still_registers():
    _, cas = make(2)

    def body(rank):
        ca = cas[rank]
        with ca.capture():
            ca.custom_all_reduce(FakeTensor([1.0], device=f"cuda:{rank}"))
            ca.disabled = True  # what SGLang's piecewise graph runner does
            assert ca.custom_all_reduce(FakeTensor([1.0], device=f"cuda:{rank}")) is None
        ca.disabled = ca.original_disabled
        assert ca.custom_all_reduce(FakeTensor([5.0], device=f"cuda:{rank}")).values == [10.0]
        return ca._runtime.comm.calls

    for calls in run_ranks(2, body):
        assert calls == [("all_reduce", 1), ("register_graph_buffers",), ("all_reduce", 1)]


def test_close_is_final_and_idempotent():
    _, cas = make(2)
    for ca in cas:
        comm = ca._runtime.comm
        ca.close()
        ca.close()
        assert ca.disabled and comm.closed and comm.calls.count(("close",)) == 1
        assert ca.custom_all_reduce(FakeTensor([1.0], device=ca.device)) is None


def fused_reference(seed, world, rows, hidden, eps):
    """(residual, normed) in float64, computed here from the inputs: the
    sum over ranks of the input plus the residual, then RMSNorm times the
    weight. The residual and weight are the same on every rank (cases
    1000 and 1001)."""
    n = rows * hidden
    total = reference_sum(seed, 0, world, n)
    residual = [math.fsum((s, r)) for s, r in zip(total, rank_values(seed, 1000, 0, n))]
    weight = rank_values(seed, 1001, 0, hidden)
    normed = []
    for start in range(0, n, hidden):
        row = residual[start : start + hidden]
        inv = 1.0 / math.sqrt(math.fsum(v * v for v in row) / hidden + eps)
        normed += [v * inv * w for v, w in zip(row, weight)]
    return residual, normed


def test_fused_allreduce_rmsnorm_returns_normed_and_the_updated_residual():
    _, cas = make(2)
    seed, world, rows, hidden = fresh_seed(), 2, 3, 4
    eps = random.Random(seed).uniform(0.5, 2.0)  # large enough to matter

    def body(rank):
        ca = cas[rank]
        dev = f"cuda:{rank}"
        x = FakeTensor(rank_values(seed, 0, rank, rows * hidden), device=dev)
        residual = FakeTensor(rank_values(seed, 1000, 0, rows * hidden), device=dev)
        weight = FakeTensor(rank_values(seed, 1001, 0, hidden), device=dev)
        normed, res = ca.fused_allreduce_rmsnorm(x, residual, weight, eps)
        assert res is residual, "the residual is updated in place"
        # Not for us: another dtype, or rows that do not match the weight.
        odd = FakeTensor([1.0, 2.0, 3.0, 4.0, 5.0], device=dev)
        assert ca.fused_allreduce_rmsnorm(x, residual, FakeTensor([1.0] * hidden, "float32", dev), eps) is None
        assert ca.fused_allreduce_rmsnorm(x, residual, odd, eps) is None
        ca.disabled = True
        assert ca.fused_allreduce_rmsnorm(x, residual, weight, eps) is None
        return normed.values, res.values

    want_residual, want_normed = fused_reference(seed, world, rows, hidden, eps)
    for normed, residual in run_ranks(2, body):
        assert_close(residual, want_residual, "residual", seed)
        assert_close(normed, want_normed, "normed", seed)


# ------------------------------------------------------------------ the patch
def fake_sglang_module():
    m = types.ModuleType(adapter_module.TARGET_MODULE)

    def original(*args, **kwargs):
        return "sglang's own class"

    m.dispatch_custom_allreduce = original
    return m, original


def test_patch_replaces_the_dispatcher_for_both_call_styles():
    m, original = fake_sglang_module()
    assert patch(m) is True
    assert m.dispatch_custom_allreduce is dispatch_custom_allreduce
    assert m._tp_allreduce_original_dispatch is original
    assert m.dispatch_custom_allreduce() is TpAllreduceCustomAllreduce  # older SGLang
    assert m.dispatch_custom_allreduce(group="cpu", device="cuda:0") is TpAllreduceCustomAllreduce
    assert patch(m) is True and m._tp_allreduce_original_dispatch is original, "idempotent"


def test_patch_refuses_a_module_without_a_dispatcher():
    assert patch(types.ModuleType("sglang_without_dispatch")) is False


FAKE_SGLANG_FILES = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/distributed/__init__.py": "",
    "sglang/srt/distributed/device_communicators/__init__.py": "",
    "sglang/srt/distributed/device_communicators/custom_all_reduce.py": textwrap.dedent(
        """
        class CustomAllreduce:
            pass

        def dispatch_custom_allreduce(*args, **kwargs):
            return CustomAllreduce
        """
    ),
    "sglang/launch_server.py": textwrap.dedent(
        """
        import os, sys
        from sglang.srt.distributed.device_communicators import custom_all_reduce as m
        if __name__ == "__main__":
            cls = m.dispatch_custom_allreduce(group=None, device=None)
            print("dispatch ->", cls.__module__ + "." + cls.__name__)
            print("argv ->", " ".join(sys.argv[1:]))
            print("env ->", os.environ.get("TP_ALLREDUCE_SGLANG"))
        """
    ),
}


@pytest.fixture
def fake_sglang(tmp_path):
    for rel, text in FAKE_SGLANG_FILES.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def run_python(args, pythonpath, env_switch):
    env = {k: v for k, v in os.environ.items() if k != "TP_ALLREDUCE_SGLANG"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), os.environ.get("PYTHONPATH", "")) if p)
    if env_switch is not None:
        env["TP_ALLREDUCE_SGLANG"] = env_switch
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=60)


DISPATCH_PROBE = (
    "from sglang.srt.distributed.device_communicators import custom_all_reduce as m;"
    "c = m.dispatch_custom_allreduce(group=None, device=None); print(c.__module__ + '.' + c.__name__)"
)


def test_import_hook_patches_sglang_when_it_is_imported(fake_sglang):
    probe = "import tp_allreduce._sglang_hook as h; h.install(); " + DISPATCH_PROBE
    r = run_python(["-c", probe], fake_sglang, env_switch=None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "tp_allreduce.integrations.sglang.TpAllreduceCustomAllreduce"


def pth_installed():
    import site

    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    return any(os.path.exists(os.path.join(d, "tp_allreduce_sglang.pth")) for d in dirs)


def test_env_switch_patches_every_process_through_the_pth_file(fake_sglang):
    # Installed with pip (CI's venv, run-gpu-checks.sh's venv), the .pth file
    # is in site-packages; run from a source tree it is not (a visible skip,
    # a failure under TP_ALLREDUCE_REQUIRE_GPU=1, where the harness installs).
    require(pth_installed(), "tp_allreduce_sglang.pth is not in site-packages (package not installed from the wheel)")
    on = run_python(["-c", DISPATCH_PROBE], fake_sglang, env_switch="1")
    assert on.returncode == 0, on.stderr
    assert on.stdout.strip() == "tp_allreduce.integrations.sglang.TpAllreduceCustomAllreduce"
    for value in (None, "0"):
        off = run_python(["-c", DISPATCH_PROBE], fake_sglang, env_switch=value)
        assert off.returncode == 0, off.stderr
        assert off.stdout.strip() == "sglang.srt.distributed.device_communicators.custom_all_reduce.CustomAllreduce"


def test_module_launcher_runs_sglang_patched_with_the_switch_set(fake_sglang):
    r = run_python(["-m", "tp_allreduce.sglang", "--model-path", "m", "--tp", "8"], fake_sglang, env_switch=None)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "dispatch -> tp_allreduce.integrations.sglang.TpAllreduceCustomAllreduce" in lines
    assert "argv -> --model-path m --tp 8" in lines
    assert "env -> 1" in lines, "worker processes inherit the switch"


# ---------------------------------------------------------------- counters
def test_counters_tell_each_path_apart():
    from tp_allreduce.integrations import counters

    before = counters()
    _, cas = make(2)
    seed = fresh_seed()

    def body(rank):
        ca = cas[rank]
        ok = FakeTensor(rank_values(seed, 0, rank, 8), "bfloat16", f"cuda:{rank}")
        assert ca.should_custom_ar(ok)
        ca.custom_all_reduce(ok)
        assert not ca.should_custom_ar(FakeTensor([1.0], "int32", f"cuda:{rank}"))  # declined: the engine's path
        weight = FakeTensor([1.0] * 4, "bfloat16", f"cuda:{rank}")
        residual = FakeTensor([0.0] * 8, "bfloat16", f"cuda:{rank}")
        assert ca.fused_allreduce_rmsnorm(ok, residual, weight, 1e-6) is not None
        assert ca.fused_allreduce_rmsnorm(ok, residual, FakeTensor([1.0] * 3, "bfloat16", f"cuda:{rank}"), 1e-6) is None
        return dict(ca.counters)

    for got in run_ranks(2, body):
        assert got == {"ours": 1, "declined": 1, "fused": 1, "fused_declined": 1, "all_gather": 0, "reduce_scatter": 0}
    after = counters()
    assert after["groups"] - before["groups"] == 2
    assert {k: after[k] - before[k] for k in ("ours", "declined", "fused", "fused_declined")} == {
        "ours": 2, "declined": 2, "fused": 2, "fused_declined": 2}
    for ca in cas:
        ca.close()


# ---------------------------------------------------------------- the .pth never hurts
BROKEN_PACKAGE = {"tp_allreduce/__init__.py": "raise ImportError('libfoo.so: cannot open shared object file')\n"}


def write_tree(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_broken_install_costs_one_warning_line_and_no_traceback(tmp_path):
    require(pth_installed(), "tp_allreduce_sglang.pth is not in site-packages (package not installed from the wheel)")
    write_tree(tmp_path, FAKE_SGLANG_FILES)
    write_tree(tmp_path, BROKEN_PACKAGE)  # shadows the installed package: its import fails as a bad native load does
    probe = DISPATCH_PROBE + "; import sglang.srt.distributed.device_communicators.custom_all_reduce; print('alive')"
    r = run_python(["-c", probe], tmp_path, env_switch="1")
    assert r.returncode == 0 and r.stdout.splitlines() == [
        "sglang.srt.distributed.device_communicators.custom_all_reduce.CustomAllreduce",
        "alive",
    ], r.stdout + r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("WARNING tp-allreduce: TP_ALLREDUCE_SGLANG=1 is set but tp-allreduce could not be loaded")
    assert "libfoo.so" in lines[0] and "pip install --force-reinstall" in lines[0]
    assert "Traceback" not in r.stderr
    off = run_python(["-c", probe], tmp_path, env_switch=None)
    assert off.returncode == 0 and off.stderr == "", off.stderr


def imported_modules(pythonpath, switch, code="pass"):
    r = run_python(["-X", "importtime", "-c", code], pythonpath, env_switch=switch)
    assert r.returncode == 0, r.stderr
    return {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}


def test_unrelated_processes_import_nothing_of_the_package(fake_sglang):
    """Switch off: nothing of ours. On: only the small boot module until
    SGLang's distributed layer is imported; then the hook."""
    require(pth_installed(), "tp_allreduce_sglang.pth is not in site-packages (package not installed from the wheel)")
    ours = lambda mods: {m for m in mods if "tp_allreduce" in m}  # noqa: E731
    assert ours(imported_modules(fake_sglang, None)) == set()
    assert ours(imported_modules(fake_sglang, "1")) == {"_tp_allreduce_boot"}
    used = ours(imported_modules(fake_sglang, "1", DISPATCH_PROBE))
    assert {"_tp_allreduce_boot", "tp_allreduce._sglang_hook"} <= used


PLUGIN_ERA_FILES = dict(
    FAKE_SGLANG_FILES,
    **{
        "sglang/srt/plugins/__init__.py": textwrap.dedent(
            """
            calls = []
            def load_plugins():
                calls.append(1)
            """
        ),
        "sglang/srt/plugins/hook_registry.py": "class HookRegistry:\n    pass\n",
        "sglang/srt/distributed/parallel_state.py": textwrap.dedent(
            """
            class GroupCoordinator:
                def __init__(self):
                    self.built = True
            """
        ),
    },
)

PLUGIN_ERA_PROBE = (
    "import sglang.srt.distributed.parallel_state as ps, sglang.srt.plugins as pl;"
    + DISPATCH_PROBE
    + "; before = len(pl.calls); ps.GroupCoordinator(); print(before, len(pl.calls))"
)


def test_pth_leaves_plugin_era_sglang_to_its_plugins_and_triggers_them(tmp_path):
    """SGLang with plugins: the .pth patches none of the hook targets (SGLang's
    HookRegistry applies them), it only makes the first GroupCoordinator run
    SGLang's load_plugins() in processes that never call it."""
    require(pth_installed(), "tp_allreduce_sglang.pth is not in site-packages (package not installed from the wheel)")
    write_tree(tmp_path, PLUGIN_ERA_FILES)
    r = run_python(["-c", PLUGIN_ERA_PROBE], tmp_path, env_switch="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == [
        "sglang.srt.distributed.device_communicators.custom_all_reduce.CustomAllreduce",
        "0 1",
    ], r.stdout


def test_all_gather_and_reduce_scatter_decline_non_float_tensors():
    """Only float tensors reach tp-allreduce's all-gather and reduce-scatter
    through the adapter; an int32 tensor (ids, masks, packed data) goes to
    the engine's own path. (The all-gather is a bit-exact copy now, but the
    adapter keeps to the dtypes the library names.)"""
    _, cas = make(2)
    ca = cas[0]
    ca.comm.all_gather = lambda t: t
    ca.comm.reduce_scatter = lambda t: t
    floats = FakeTensor([0.0] * 8)
    ints = FakeTensor([0.0] * 8, dtype="int32")
    assert ca.should_custom_ag(floats), "a float tensor of 16 bytes is taken"
    assert not ca.should_custom_ag(ints)
    assert ca.gather_rows(ints) is None
    assert ca.scatter_rows(ints) is None


# ---------------------------------------------------------------- never slower than NCCL
NCCL_FROM = 64 * 1024  # bytes (a call's, or a block a rank): the fake plans' NCCL sizes


def nccl_when_large_and_eager(what, nbytes, capturing):
    """The fake plans: NCCL's for eager calls of NCCL_FROM bytes or more,
    ours for everything captured (graph replay favours ours)."""
    return nbytes >= NCCL_FROM and not capturing


def test_sizes_whose_plan_is_nccl_are_declined_to_the_engine():
    """Where the communicator's plan runs NCCL's path, each gate declines
    (allreduce, fused, all-gather, reduce-scatter) and the engine's own path
    runs; smaller sizes, and the same size captured into a graph, are taken.
    One plan is asked per (what, size, dtype, capturing), whatever the calls."""
    _, cas = make(2, {r: {"nccl_rule": nccl_when_large_and_eager} for r in range(2)})

    def body(rank):
        ca = cas[rank]
        comm = ca.comm
        comm.all_gather = lambda t: FakeTensor(t.values * 2, t.dtype, t.device)
        comm.reduce_scatter = lambda t: FakeTensor(t.values[: len(t.values) // 2], t.dtype, t.device)
        dev = f"cuda:{rank}"
        small = FakeTensor([1.0] * 1024, "bfloat16", dev)  # 2 KiB
        large = FakeTensor([1.0] * (NCCL_FROM // 2), "bfloat16", dev)  # 64 KiB
        for _ in range(3):
            assert ca.should_custom_ar(small)
            assert not ca.should_custom_ar(large), "NCCL's size: the engine's path"
            assert ca.custom_all_reduce(large) is None
        assert ca.custom_all_reduce(small).values == [2.0] * 1024
        # f32 of the same bytes: the same plan, asked separately per dtype.
        assert not ca.should_custom_ar(FakeTensor([1.0] * (NCCL_FROM // 4), "float32", dev))
        # Fused: rows x hidden of 64 KiB is NCCL's, 2 KiB ours.
        weight = FakeTensor([1.0] * 512, "bfloat16", dev)
        assert ca.fused_allreduce_rmsnorm(large, FakeTensor([0.0] * len(large.values), "bfloat16", dev), weight, 1e-6) is None
        assert ca.fused_allreduce_rmsnorm(small, FakeTensor([0.0] * 1024, "bfloat16", dev), weight, 1e-6) is not None
        # All-gather: the block a rank; reduce-scatter: the share a rank.
        assert ca.should_custom_ag(small) and ca.gather_rows(small) is not None
        assert not ca.should_custom_ag(large) and ca.gather_rows(large) is None
        assert ca.scatter_rows(small) is not None
        assert ca.scatter_rows(FakeTensor([1.0] * NCCL_FROM, "bfloat16", dev)) is None, "a 64 KiB share"
        assert ca.scatter_rows(FakeTensor([1.0] * (NCCL_FROM - 16), "bfloat16", dev)) is not None, "a share below"
        # Captured: the replay's plan is ours, so the same size is taken.
        with ca.capture():
            with comm.graph():
                assert ca.should_custom_ar(large)
                captured = ca.custom_all_reduce(large)
        assert captured is not None
        return dict(ca.counters), list(comm.plans)

    for counters, plans in run_ranks(2, body):
        assert counters["ours"] == 2 and counters["declined"] == 4, counters
        assert counters["fused"] == 1 and counters["fused_declined"] == 1, counters
        assert counters["all_gather"] == 1 and counters["reduce_scatter"] == 2, counters
        assert plans.count(("allreduce", NCCL_FROM, False)) == 2, f"once per dtype: {plans}"
        assert plans.count(("allreduce", 2048, False)) == 1, plans
        assert ("allreduce", NCCL_FROM, True) in plans, "capture asks the replay's plan"
    for ca in cas:
        ca.close()


def test_size_independent_mode_never_declines_to_the_engine():
    """Size-independent mode keeps every size (the engine's NCCL would not
    be size-independent), even where the plan says NCCL."""
    group = FakeGroup(2)

    def body(rank):
        rt = FakeRuntime(rank, group, nccl_rule=lambda *_: True)
        ca = TpAllreduceCustomAllreduce(group=group, device=f"cuda:{rank}", runtime=rt, size_independent=True)
        ok = ca.should_custom_ar(FakeTensor([1.0] * 4096, "bfloat16", f"cuda:{rank}"))
        ca.close()
        return ok, rt.comm.plans

    assert run_ranks(2, body) == [(True, []), (True, [])]


def test_a_call_traced_by_torch_compile_never_asks_whether_a_stream_captures():
    """Under torch.compile the NCCL-size check is skipped (asking the CUDA
    runtime whether a stream captures breaks the trace; the answer would be
    baked into the graph): the call is taken, and no plan is asked."""
    _, cas = make(2)
    ca = cas[0]
    rt = ca._runtime
    rt.tracing = True
    asked = []
    ca.comm.plan = lambda *a: asked.append(a) or ("nccl", "p2p", "fed")
    rt.capturing = lambda: (_ for _ in ()).throw(AssertionError("asked whether a stream captures"))
    assert ca.should_custom_ar(FakeTensor([0.0] * 8))
    assert asked == []
