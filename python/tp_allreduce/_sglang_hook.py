"""Applies the SGLang patch in this process as soon as SGLang's
custom-allreduce module is imported (or now, if it already is). Imported by
``tp_allreduce_sglang.pth`` at interpreter start when TP_ALLREDUCE_SGLANG=1,
and by ``python -m tp_allreduce.sglang``. Never raises: a failure is logged
and SGLang runs unpatched."""

import importlib.abc
import logging
import sys

from .integrations.sglang import TARGET_MODULE, patch

logger = logging.getLogger("tp_allreduce")


class _PatchAfterExec(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            patch(module)
        except Exception as e:  # never break SGLang's import
            logger.warning("tp-allreduce: patching %s failed: %s", TARGET_MODULE, e)


class PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds SGLang's module with the other finders and wraps its loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchAfterExec(spec.loader)
                return spec
        return None


def install() -> None:
    """Idempotent."""
    if any(isinstance(f, PatchingFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, PatchingFinder())
    already = sys.modules.get(TARGET_MODULE)
    if already is not None:
        patch(already)


try:
    install()
except Exception as e:  # pragma: no cover (defensive: interpreter start must not fail)
    logger.warning("tp-allreduce: installing the SGLang hook failed: %s", e)
