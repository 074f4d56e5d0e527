"""The dry run's import phase (``run_checks --dry-run``; CPU): one process
that imports what a run imports on the GPU machine, with CUDA and NVML
stood in (cpu_stand_ins.py) so the engines' CUDA-gated imports happen:

* every module of <engine>-seeds.txt (or <engine>-<version>-seeds.txt, prepare.seeds_file) (the checked path's modules, from
  which prepare.py trimmed the carried engine wheel);
* the check module and its own imports (``body_imports``);
* SGLang: the .pth hook's patches, and ServerArgs as the check builds it;
  vLLM: the platform resolution from the installed entry points (the
  check's own ``platform_resolution``).

    python -m engine_checks.dry_imports ENGINE MODE OUT_DIR RUN_NAME
"""

import importlib
import os
import sys
import traceback

from engine_checks.common import Recorder, engine_modules, imported_distributions, raise_if
from engine_checks.prepare import seeds_file
from engine_checks.run_checks import EXPECT_VERSION

HERE = os.path.dirname(os.path.abspath(__file__))


def where(exc):
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    return " <- ".join(f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in reversed(frames))


def main():
    engine, mode, out_dir, name = sys.argv[1:5]
    rec = Recorder(name, 0, out_dir, label="imports")
    rec.guard(lambda: run(rec, engine, mode))


def run(rec, engine, mode):
    from engine_checks.cpu_stand_ins import pretend_cuda, pretend_nvml

    pretend_cuda()
    if engine == "vllm":
        pretend_nvml()

    def seeds():
        version = os.environ.get(EXPECT_VERSION)
        path = seeds_file(f"{engine}-{version}" if version else engine, engine)
        with open(path) as f:
            mods = [line.strip() for line in f if line.strip() and not line.startswith("#")]
        failed = []
        for mod in mods:
            if mod in sys.modules:
                continue
            try:
                importlib.import_module(mod)
            except BaseException as e:  # noqa: BLE001 (a module calling exit() is a finding too)
                failed.append(f"{mod}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (at {where(e)})")
        raise_if(failed)
        return f"{len(mods)} modules of {os.path.basename(path)} imported (CUDA stood in)"

    rec.run("seed_modules_import", seeds)

    check = importlib.import_module(f"engine_checks.{engine}_check")

    def own():
        check.body_imports()
        return f"engine_checks.{engine}_check and its body_imports()"

    rec.run("check_imports", own)

    if engine == "sglang":

        def plugin():
            import importlib.metadata as md

            from sglang.srt.distributed import parallel_state as ps
            from sglang.srt.plugins import load_plugins
            from tp_allreduce.integrations.sglang import hooks_applied

            problems = []
            ours = [e.value for e in md.entry_points(group="sglang.srt.plugins") if e.name == "tp_allreduce"]
            if ours != ["_tp_allreduce_boot:sglang_plugin"]:
                problems.append(f"sglang.srt.plugins entry point tp_allreduce: {ours}")
            before = {t: how for t, how in hooks_applied().items() if how is not None}
            if before:
                problems.append(f"hooked before load_plugins() (the .pth must leave these to SGLang's plugins): {before}")
            if getattr(ps.GroupCoordinator.__init__, "_tp_allreduce_original", None) is None:
                problems.append("the .pth's load_plugins trigger is not on GroupCoordinator.__init__")
            load_plugins()  # as run_scheduler_process does first
            problems += check.patches_installed()
            raise_if(problems)
            return ("entry point sglang.srt.plugins:tp_allreduce; nothing hooked before load_plugins(); after it, "
                    "4 targets hooked through SGLang's HookRegistry")

        rec.run("plugin_hooks_via_load_plugins", plugin)
        rec.run("server_args_on_cuda", lambda: f"ServerArgs(model_path='dummy', tp_size=2) built: {type(check.server_args(2)).__name__}")
    else:

        def platform():
            problems, description = check.platform_problems(mode)
            raise_if(problems)
            return description

        rec.run("platform_resolution", platform)
    rec.facts["distributions"] = imported_distributions()
    rec.facts["modules"] = engine_modules()


if __name__ == "__main__":
    main()
