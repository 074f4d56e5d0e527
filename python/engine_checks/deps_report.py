"""Prints how the packages installed in an engine's venv meet the
requirements (``Requires-Dist``, markers evaluated here) of the engine and
of the carried wheels (run by run-on-gpu.sh in each venv; a report, never a
failure: prepare.py already failed on carried wheels that do not meet them;
what this adds is the GPU image's own packages, whose versions only show
there).

    python deps_report.py ENGINE CARRY/ENGINE.install
"""

import importlib.metadata as md
import sys

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name


def main():
    engine, install_list = sys.argv[1], sys.argv[2]
    with open(install_list) as f:
        carried = {canonicalize_name(line.split("-")[0]) for line in f if line.strip()}
    installed = {}
    for d in md.distributions():  # sys.path order: the first one is the one imported
        installed.setdefault(canonicalize_name(d.metadata["Name"]), d)
    roots = sorted(carried | {canonicalize_name("tp-allreduce")})
    differs, absent = [], {}
    for key in roots:
        dist = installed.get(key)
        if dist is None:
            print(f"deps {engine}: {key} is not installed")
            continue
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            have = installed.get(canonicalize_name(req.name))
            who = f"{dist.metadata['Name']} {dist.version}"
            if have is None:
                absent.setdefault(who, []).append(req.name)
            elif not req.specifier.contains(have.version, prereleases=True):
                where = "carried" if canonicalize_name(req.name) in carried else "GPU image"
                differs.append(f"{who} requires {req}; installed ({where}): {have.version}")
    for line in differs:
        print(f"deps {engine}: version differs: {line}")
    n_absent = sum(len(v) for v in absent.values())
    print(
        f"deps {engine}: {len(roots)} carried distributions checked; {len(differs)} requirement(s) met by another version; "
        f"{n_absent} not installed (the engines name many packages the checked path never imports)"
    )
    for who, names in sorted(absent.items()):
        if not who.lower().startswith(engine):
            print(f"deps {engine}: {who}: not installed: {', '.join(sorted(set(names)))}")


if __name__ == "__main__":
    main()
