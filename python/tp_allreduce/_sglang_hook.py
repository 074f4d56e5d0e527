"""Applies the SGLang patches in this process as soon as SGLang imports the
modules they patch (``integrations.sglang.PATCHES``; or now, for those
already imported). Imported by
``tp_allreduce_sglang.pth`` at interpreter start when TP_ALLREDUCE_SGLANG=1,
and by ``python -m tp_allreduce.sglang``. Never raises: a failure is logged
and SGLang runs unpatched."""

import importlib.abc
import logging
import sys

from .integrations.sglang import PATCHES

logger = logging.getLogger("tp_allreduce")


class _PatchAfterExec(importlib.abc.Loader):
    def __init__(self, loader, name):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            PATCHES[self._name](module)
        except Exception as e:  # never break SGLang's import
            logger.warning("tp-allreduce: patching %s failed: %s", self._name, e)


class PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds SGLang's module with the other finders and wraps its loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchAfterExec(spec.loader, fullname)
                return spec
        return None


def install() -> None:
    """Idempotent."""
    if any(isinstance(f, PatchingFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, PatchingFinder())
    for name, apply in PATCHES.items():
        already = sys.modules.get(name)
        if already is not None:
            apply(already)


try:
    install()
except Exception as e:  # pragma: no cover (defensive: interpreter start must not fail)
    logger.warning("tp-allreduce: installing the SGLang hook failed: %s", e)
