"""Prepares what the engine harness carries to the GPU machine, and what the
CPU fidelity test reads (stdlib only; Python >= 3.9; needs PyPI).

    python3 python/engine_checks/prepare.py [--out DIR] [--keep-downloads]

Into DIR (default: .engine-wheels/ at the repository root, git-ignored):

* download/  the pinned engine wheels (sglang, vllm; cp312 manylinux) as
             PyPI serves them (deleted at the end unless --keep-downloads:
             vLLM's is ~340 MB);
* carry/     what run-on-gpu.sh pip-installs, every file a wheel:
             - trimmed engine wheels: the engine's own Python files that the
               checked path imports (the modules of <engine>-seeds.txt and
               everything they import at module level, found with ``ast``),
               plus the data files next to them, plus the stub modules of
               stubs/<engine>/ (listed in README.md), plus the wheel's own
               dist-info (METADATA, entry points) with a new RECORD. Same
               file name and tags as the original wheel;
             - the pinned small dependencies (pins.txt) that the GPU image
               lacks, as PyPI's cp312 manylinux wheels;
* MANIFEST.txt  every carried file with its size and sha256, the total.

The total must stay well under 40 MiB (a GPU call carries 64 MiB in all).
"""

import argparse
import ast
import base64
import hashlib
import io
import os
import shutil
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PY_TAGS = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
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
        "vllm/plugins/__init__.py",
    ),
}
# Data files next to carried modules are kept when small and of these kinds
# (configs, templates); kernel sources, tuned-kernel tables and binaries not.
DATA_EXT = (".json", ".yaml", ".yml", ".jinja", ".jinja2", ".txt", ".typed")
DATA_MAX_BYTES = 64 << 10
MAX_TOTAL = 40 << 20


def read_pins():
    """{"engines": {name: version}, "deps": [(name, version)]} from pins.txt."""
    engines, deps = {}, []
    with open(os.path.join(HERE, "pins.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            kind, spec = line.split(None, 1)
            name, version = spec.split("==")
            (deps.append((name, version)) if kind == "dep" else engines.__setitem__(name, version))
    return {"engines": engines, "deps": deps}


def pip_download(specs, dest):
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps"]
    cmd += PY_TAGS + [a for p in PLATFORMS for a in ("--platform", p)] + ["-d", dest] + list(specs)
    subprocess.run(cmd, check=True)


def _norm(name):
    return name.lower().replace("-", "_").replace(".", "_")


def find_wheel(folder, name, version):
    for f in sorted(os.listdir(folder)):
        parts = f.split("-")
        if f.endswith(".whl") and len(parts) >= 3 and _norm(parts[0]) == _norm(name) and parts[1] == version:
            return os.path.join(folder, f)
    raise SystemExit(f"prepare: no wheel for {name}=={version} in {folder}")


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

    def walk(node):
        for child in ast.iter_child_nodes(node):
            if not deep and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
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
    stubs = {}
    if os.path.isdir(stub_dir):
        for fn in sorted(os.listdir(stub_dir)):
            if fn.endswith(".py"):
                with open(os.path.join(stub_dir, fn), "rb") as f:
                    stubs[f"{pkg}/{fn}"] = f.read()
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, ".engine-wheels"))
    ap.add_argument("--keep-downloads", action="store_true")
    args = ap.parse_args()
    pins = read_pins()
    download = os.path.join(args.out, "download")
    carry = os.path.join(args.out, "carry")
    os.makedirs(download, exist_ok=True)
    if os.path.isdir(carry):
        shutil.rmtree(carry)
    os.makedirs(carry)
    for name, version in pins["engines"].items():
        try:
            find_wheel(download, name, version)
        except SystemExit:
            print(f"prepare: downloading {name}=={version}", flush=True)
            pip_download([f"{name}=={version}"], download)
        wheel = find_wheel(download, name, version)
        out, kept, total = trimmed_wheel(wheel, name, os.path.join(HERE, f"{name}-seeds.txt"), carry)
        print(f"prepare: {os.path.basename(out)}: {kept} of {total} files carried", flush=True)
    print(f"prepare: downloading {len(pins['deps'])} pinned dependencies", flush=True)
    pip_download([f"{n}=={v}" for n, v in pins["deps"]], carry)
    for name, version in pins["deps"]:
        find_wheel(carry, name, version)  # each pin arrived, in its version
    lines, total = [], 0
    for fn in sorted(os.listdir(carry)):
        path = os.path.join(carry, fn)
        with open(path, "rb") as f:
            data = f.read()
        total += len(data)
        lines.append(f"{len(data):>10}  {hashlib.sha256(data).hexdigest()}  {fn}")
    lines.append(f"{total:>10}  total ({total / (1 << 20):.1f} MiB) in {carry}")
    with open(os.path.join(args.out, "MANIFEST.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not args.keep_downloads:
        shutil.rmtree(download)
    if total > MAX_TOTAL:
        raise SystemExit(f"prepare: {total / (1 << 20):.1f} MiB to carry, over the 40 MiB budget")


if __name__ == "__main__":
    main()
