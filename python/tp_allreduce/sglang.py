"""``python -m tp_allreduce.sglang <sglang.launch_server arguments>``: runs
SGLang's server with tp-allreduce as its custom allreduce.

Sets TP_ALLREDUCE_SGLANG=1 (inherited by SGLang's worker processes, where
``tp_allreduce_sglang.pth`` applies the patch), applies the patch in this
process, then runs ``sglang.launch_server`` as ``__main__``.
"""

import os
import runpy
import site
import sys

PTH_NAME = "tp_allreduce_sglang.pth"


def _pth_installed() -> bool:
    dirs = list(getattr(site, "getsitepackages", lambda: [])())
    user = getattr(site, "getusersitepackages", lambda: None)()
    if user:
        dirs.append(user)
    return any(os.path.exists(os.path.join(d, PTH_NAME)) for d in dirs)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ["TP_ALLREDUCE_SGLANG"] = "1"
    from . import _sglang_hook

    _sglang_hook.install()
    if not _pth_installed():
        print(
            f"tp_allreduce.sglang: warning: {PTH_NAME} is not in this environment's site-packages "
            "(installed with pip --target?); SGLang's worker processes will not be patched. "
            "Install the wheel with a plain `pip install` into SGLang's environment.",
            file=sys.stderr,
        )
    sys.argv = ["sglang.launch_server", *argv]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
