"""Prepares what the engine harness carries to the GPU machine, and what the
CPU fidelity test reads (stdlib and pip only; Python >= 3.9; needs PyPI).

    python3 python/engine_checks/prepare.py [--out DIR] [--keep-downloads]
                                            [--python-version 3.12]

Into DIR (default: .engine-wheels/ at the repository root, git-ignored):

* download/  the pinned engine wheels (sglang, vllm; manylinux) as PyPI
             serves them (deleted at the end unless --keep-downloads:
             vLLM's is ~340 MB);
* carry/     what run-on-gpu.sh pip-installs, every file a wheel:
             - trimmed engine wheels: the engine's own Python files that the
               checked path imports (the modules of <engine>-seeds.txt and
               everything they import at module level, found with ``ast``;
               not what ``if TYPE_CHECKING:`` blocks import, which never
               runs),
               plus the data files next to them, plus the files of
               stubs/<engine>/ (listed in README.md), plus the wheel's own
               dist-info (METADATA, entry points) with a new RECORD. Same
               file name and tags as the original wheel;
             - the pinned small dependencies (pins.txt) that the GPU image
               lacks, as PyPI's manylinux wheels;
             - <venv>.install: the wheels of one venv (the engine's own
               and its dependencies'): SGLang and vLLM pin some packages to
               different versions (openai), so each engine gets its own
               venv, and each pinned version of an engine its own
               (``venvs()``: sglang, vllm-0.33.0, vllm-0.34.0);
* MANIFEST.txt  every carried file with its size and sha256, the total.

Every carried dependency is checked against the engine's own
``Requires-Dist`` (its wheel's METADATA: markers evaluated for CPython
3.12 on x86_64 Linux) and against the ``Requires-Dist`` of the other wheels
of the same venv; a mismatch fails prepare. Requirements met by neither the
carry nor the GPU image (gpu-image.txt) are listed, not fatal: the engines
name many packages that the checked path never imports (the dry run,
``run_checks --dry-run``, imports the path).

The total must stay under CARRY_BUDGET (with tp-allreduce's own wheel,
~5.5 MiB, under 33 MiB).

``--python-version 3.11`` (or another) builds the same carry for that
Python (the CPU dry run here; the GPU machine has 3.12).
"""

import argparse
import ast
import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PYTHON_VERSION = "3.12"  # the GPU machine's (/opt/torch/.venv)
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64"]
# Modules whose function bodies run in the checks: their function-level
# imports count too.
DEEP = {
    "sglang": ("sglang.srt.distributed", "sglang.srt.layers.layernorm", "sglang.srt.layers.flashinfer_comm_fusion"),
    "vllm": ("vllm.distributed",),
}
# Files the fidelity test reads besides the closure.
ALSO = {
    "sglang": (
        "sglang/srt/layers/layer_boundary/residual/add_norm.py",
        "sglang/srt/layers/layer_boundary/exit.py",
        "sglang/srt/layers/layer_boundary/fusions/allreduce.py",
        "sglang/srt/arg_groups/overrides.py",
        "sglang/srt/model_executor/cuda_graph_runner.py",
    ),
    "vllm": (
        "vllm/distributed/stateless_coordinator.py",
        "vllm/config/vllm.py",
        "vllm/models/common/ops/sequence_parallel.py",
        "vllm/models/deepseek_v41/nvidia/model.py",
        "vllm/models/deepseek_v41/nvidia/ops/mhc.py",
        "vllm/models/deepseek_v41/nvidia/specialized_decode/logits/logits.py",
        "vllm/v1/worker/gpu_model_runner.py",
        "vllm/v1/worker/gpu/cudagraph_utils.py",
        "vllm/v1/worker/gpu/model_runner.py",
        "vllm/plugins/__init__.py",
    ),
}
# Data files next to carried modules are kept when small and of these kinds
# (configs, templates); kernel sources, tuned-kernel tables and binaries not.
DATA_EXT = (".json", ".yaml", ".yml", ".jinja", ".jinja2", ".txt", ".typed")
DATA_MAX_BYTES = 64 << 10
# The GPU call carries this and tp-allreduce's wheel (~5.5 MiB) in 33 MiB.
CARRY_BUDGET = int(27.5 * (1 << 20))
ENGINES = ("sglang", "vllm")


def read_pins():
    """{"engines": [(name, version)], "deps": [(name, version, engines)]}
    from pins.txt (an engine may be pinned in several versions; a dep line
    names the engines whose venvs get it; none: all)."""
    engines, deps = [], []
    with open(os.path.join(HERE, "pins.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            kind, spec, *users = line.split()
            name, version = spec.split("==")
            if kind == "engine":
                engines.append((name, version))
                continue
            unknown = set(users) - set(ENGINES)
            if kind != "dep" or unknown:
                raise SystemExit(f"prepare: pins.txt: cannot read {line!r}")
            deps.append((name, version, tuple(users) or ENGINES))
    return {"engines": engines, "deps": deps}


def venvs(pins):
    """[(venv, engine, version)]: one venv per pinned engine version, named
    after the engine, or ``<engine>-<version>`` where the engine is pinned
    in more than one version (vLLM 0.33.0 and 0.34.0)."""
    count = {}
    for name, _ in pins["engines"]:
        count[name] = count.get(name, 0) + 1
    return [(name if count[name] == 1 else f"{name}-{version}", name, version) for name, version in pins["engines"]]


def seeds_file(venv, engine):
    """The modules the checked path imports for one venv:
    ``<venv>-seeds.txt`` where a pinned version has its own list
    (vllm-0.34.0-seeds.txt), else ``<engine>-seeds.txt``."""
    own = os.path.join(HERE, f"{venv}-seeds.txt")
    return own if os.path.exists(own) else os.path.join(HERE, f"{engine}-seeds.txt")


def pip_download(specs, dest, python_version):
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps"]
    cmd += ["--python-version", python_version, "--implementation", "cp", "--only-binary=:all:"]
    cmd += [a for p in PLATFORMS for a in ("--platform", p)] + ["-d", dest] + list(specs)
    subprocess.run(cmd, check=True)


def _norm(name):
    return name.lower().replace("-", "_").replace(".", "_")


def _fits(filename, python_version):
    """Whether a wheel's python tag accepts CPython ``python_version``."""
    tags = filename[: -len(".whl")].split("-")[-3]
    want = "cp" + python_version.replace(".", "")
    for tag in tags.split("."):
        if tag in (want, "py3", f"py{python_version.replace('.', '')}"):
            return True
        if tag.startswith("cp3") and tag != want and filename.split("-")[-2] == "abi3" and int(tag[3:]) <= int(want[3:]):
            return True
    return False


def find_wheel(folder, name, version, python_version=PYTHON_VERSION):
    for f in sorted(os.listdir(folder)):
        parts = f.split("-")
        if f.endswith(".whl") and len(parts) >= 3 and _norm(parts[0]) == _norm(name) and parts[1] == version:
            if _fits(f, python_version):
                return os.path.join(folder, f)
    raise SystemExit(f"prepare: no wheel for {name}=={version} (CPython {python_version}) in {folder}")


# ---------------------------------------------------------------- closure
def _module_file(names, mod):
    base = mod.replace(".", "/")
    for cand in (base + "/__init__.py", base + ".py"):
        if cand in names:
            return cand
    return None


def _imports(mod, path, source, pkg, deep):
    tree = ast.parse(source, filename=path)
    is_pkg = path.endswith("__init__.py")

    def type_checking(node):
        test = node.test
        return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        )

    def walk(node):
        for child in ast.iter_child_nodes(node):
            if not deep and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(child, ast.If) and type_checking(child):
                # never runs: only its else branch counts
                for other in child.orelse:
                    yield other
                    yield from walk(other)
                continue
            yield child
            yield from walk(child)

    out = set()
    for node in walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)
    return {o for o in out if o == pkg or o.startswith(pkg + ".")}


def closure(zf, pkg, seeds):
    """Files of the wheel ``zf`` for ``seeds`` and what they import at
    module level (function level too under DEEP), parents' __init__ files
    included."""
    names = set(zf.namelist())
    seen, files, todo = set(), set(), list(seeds)
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        parts = mod.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        path = _module_file(names, mod)
        if path is None:
            continue
        files.add(path)
        deep = any(mod == d or mod.startswith(d + ".") for d in DEEP.get(pkg, ()))
        source = zf.read(path).decode("utf-8")
        todo.extend(_imports(mod, path, source, pkg, deep))
    return files


def trimmed_wheel(original, pkg, seeds_file, out_dir):
    """Writes the trimmed wheel; returns (path, carried files, files in the original)."""
    with open(seeds_file) as f:
        seeds = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    zf = zipfile.ZipFile(original)
    names = zf.namelist()
    files = closure(zf, pkg, seeds)
    files.update(a for a in ALSO.get(pkg, ()) if a in names)
    dirs = {os.path.dirname(p) for p in files}
    for info in zf.infolist():  # small data files beside carried modules (configs, templates)
        n = info.filename
        if os.path.dirname(n) in dirs and n.endswith(DATA_EXT) and info.file_size <= DATA_MAX_BYTES:
            files.add(n)
    dist_info = sorted({n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")})
    assert len(dist_info) == 1, dist_info
    dist_info = dist_info[0]
    keep_meta = [n for n in names if n.startswith(dist_info + "/") and not n.endswith("/RECORD")]
    stub_dir = os.path.join(HERE, "stubs", pkg)
    stubs = {}  # every file under stubs/<pkg>/, at the same path under <pkg>/
    for folder, _, fns in sorted(os.walk(stub_dir)):
        for fn in sorted(fns):
            if fn.endswith((".pyc", ".pyo")):
                continue
            rel = os.path.relpath(os.path.join(folder, fn), stub_dir).replace(os.sep, "/")
            with open(os.path.join(folder, fn), "rb") as f:
                stubs[f"{pkg}/{rel}"] = f.read()
    out = os.path.join(out_dir, os.path.basename(original))
    record = []
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as w:

        def put(name, data):
            w.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(data)}")

        for n in sorted(files):
            if n in stubs:
                continue
            put(n, zf.read(n))
        for n, data in stubs.items():
            put(n, data)
        for n in keep_meta:
            put(n, zf.read(n))
        note = (
            f"Trimmed by tp-allreduce python/engine_checks/prepare.py from {os.path.basename(original)}: "
            f"{len(files)} of {len(names)} files (the checked path's Python files and their data), "
            f"stubs {sorted(stubs)}.\n"
        ).encode()
        put(f"{dist_info}/TP_ALLREDUCE_TRIMMED", note)
        record.append(f"{dist_info}/RECORD,,")
        w.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return out, len(files), len(names)


# ---------------------------------------------------------------- requirements
def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
    except ImportError:  # pip's own copy (prepare runs pip anyway)
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.utils import canonicalize_name
    return Requirement, canonicalize_name


def wheel_metadata(path):
    """(name, version, [Requires-Dist strings]) of a wheel's METADATA."""
    with zipfile.ZipFile(path) as z:
        meta = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        text = z.read(meta[0]).decode("utf-8")
    head = text.split("\n\n", 1)[0]
    fields = [line.split(": ", 1) for line in head.splitlines() if ": " in line and not line.startswith(" ")]
    name = next(v for k, v in fields if k == "Name")
    version = next(v for k, v in fields if k == "Version")
    return name, version, [v for k, v in fields if k == "Requires-Dist"]


def marker_environment(python_version):
    """The GPU machine's marker values (CPython on x86_64 Linux)."""
    full = python_version + ".0"
    return {
        "implementation_name": "cpython",
        "implementation_version": full,
        "os_name": "posix",
        "platform_machine": "x86_64",
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_system": "Linux",
        "platform_version": "",
        "python_full_version": full,
        "python_version": python_version,
        "sys_platform": "linux",
    }


def read_image_list():
    """{canonical name: version or None} of the GPU image (gpu-image.txt)."""
    _, canon = _packaging()
    image = {}
    with open(os.path.join(HERE, "gpu-image.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, *version = line.split()
                image[canon(name)] = version[0] if version else None
    return image


def check_install_set(engine, wheels, python_version, image):
    """Every requirement between the wheels of one venv (the engine's
    Requires-Dist and each dependency's, with the extras asked for), markers
    evaluated for the GPU machine. Returns (mismatches, report lines)."""
    Requirement, canon = _packaging()
    env = marker_environment(python_version)
    metas = {}
    for path in wheels:
        name, version, requires = wheel_metadata(path)
        metas[canon(name)] = (name, version, requires)
    mismatches, image_mismatches, elsewhere = [], [], {}
    todo = [(key, ()) for key in metas]
    seen = set()
    while todo:
        key, extras = todo.pop()
        if (key, extras) in seen:
            continue
        seen.add((key, extras))
        name, version, requires = metas[key]
        for text in requires:
            req = Requirement(text)
            if req.marker is not None and not any(req.marker.evaluate(dict(env, extra=e)) for e in ("",) + extras):
                continue
            dep = canon(req.name)
            who = f"{name} {version}" + (f"[{','.join(extras)}]" if extras else "")
            if dep in metas:
                have = metas[dep][1]
                if not req.specifier.contains(have, prereleases=True):
                    mismatches.append(f"{who} requires {req}; carried for {engine}: {metas[dep][0]} {have}")
                if req.extras:
                    todo.append((dep, tuple(sorted(req.extras))))
            elif dep in image:
                have = image[dep]
                if have is not None and not req.specifier.contains(have, prereleases=True):
                    image_mismatches.append(f"{who} requires {req}; the GPU image has {have}")
            elif key == canon(engine) or not extras:
                elsewhere.setdefault(who, []).append(req.name)
    report = [f"prepare: {engine} venv: {len(metas)} wheels, every requirement between them met" if not mismatches else ""]
    report += [f"prepare: {engine} venv: NOT MET: {m}" for m in mismatches]
    report += [f"prepare: {engine} venv: the GPU image's version differs (used as it is): {m}" for m in image_mismatches]
    for who, names in sorted(elsewhere.items()):
        report.append(f"prepare: {engine} venv: {who}: not carried, not in the GPU image list (not imported on the checked path, or the dry run fails): {', '.join(sorted(set(names)))}")
    return mismatches, [r for r in report if r]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, ".engine-wheels"))
    ap.add_argument("--keep-downloads", action="store_true")
    ap.add_argument("--python-version", default=PYTHON_VERSION, help="target CPython (default %(default)s, the GPU machine's)")
    args = ap.parse_args()
    pyver = args.python_version
    pins = read_pins()
    image = read_image_list()
    download = os.path.join(args.out, "download")
    carry = os.path.join(args.out, "carry")
    os.makedirs(download, exist_ok=True)
    if os.path.isdir(carry):
        shutil.rmtree(carry)
    os.makedirs(carry)
    engine_wheels = {}  # venv -> trimmed wheel
    for venv, name, version in venvs(pins):
        try:
            find_wheel(download, name, version, pyver)
        except SystemExit:
            print(f"prepare: downloading {name}=={version}", flush=True)
            pip_download([f"{name}=={version}"], download, pyver)
        wheel = find_wheel(download, name, version, pyver)
        out, kept, total = trimmed_wheel(wheel, name, seeds_file(venv, name), carry)
        engine_wheels[venv] = out
        print(f"prepare: {os.path.basename(out)}: {kept} of {total} files carried", flush=True)
    print(f"prepare: downloading {len(pins['deps'])} pinned dependencies", flush=True)
    for engine in ENGINES:  # one call per engine: pip refuses two versions of one name in a call
        pip_download([f"{n}=={v}" for n, v, users in pins["deps"] if engine in users], carry, pyver)
    problems, report, sets = [], [], {}
    for venv, engine, _ in venvs(pins):
        wheels = [engine_wheels[venv]]
        wheels += [find_wheel(carry, n, v, pyver) for n, v, users in pins["deps"] if engine in users]
        sets[venv] = sorted(os.path.basename(w) for w in wheels)
        bad, lines = check_install_set(engine, wheels, pyver, image)
        problems += bad
        report += [line.replace(f"prepare: {engine} venv:", f"prepare: {venv} venv:", 1) for line in lines]
        with open(os.path.join(carry, f"{venv}.install"), "w") as f:
            f.write("\n".join(sets[venv]) + "\n")
    carried = {w for ws in sets.values() for w in ws}
    stray = sorted(f for f in os.listdir(carry) if f.endswith(".whl") and f not in carried)
    if stray:
        problems.append(f"downloaded but in no venv: {stray}")
    lines, total = [], 0
    for fn in sorted(os.listdir(carry)):
        path = os.path.join(carry, fn)
        with open(path, "rb") as f:
            data = f.read()
        total += len(data)
        users = ",".join(v for v in sets if fn in sets[v]) or "-"
        lines.append(f"{len(data):>10}  {hashlib.sha256(data).hexdigest()}  {fn}  [{users}]")
    lines.append(f"{total:>10}  total ({total / (1 << 20):.1f} MiB, budget {CARRY_BUDGET / (1 << 20):.1f} MiB) in {carry}")
    with open(os.path.join(args.out, "MANIFEST.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(report + lines))
    if not args.keep_downloads:
        shutil.rmtree(download)
    if problems:
        raise SystemExit("prepare: FAILED, requirements not met:\n  " + "\n  ".join(problems))
    if total > CARRY_BUDGET:
        raise SystemExit(f"prepare: {total / (1 << 20):.1f} MiB to carry, over the {CARRY_BUDGET / (1 << 20):.1f} MiB budget")
    print(f"prepare: carry {total / (1 << 20):.1f} MiB (budget {CARRY_BUDGET / (1 << 20):.1f} MiB)")


if __name__ == "__main__":
    main()
