"""The ``.pth`` path: applies patches in this process as soon as SGLang
imports the modules they patch (or now, for those already imported).
``install()`` is called by ``tp_allreduce_sglang.pth`` at interpreter start
when TP_ALLREDUCE_SGLANG=1 (through ``_tp_allreduce_boot.pth``, which turns
any failure into one warning line) and by ``python -m tp_allreduce.sglang``.

* SGLang with plugins (0.5.23 and newer): SGLang's own plugin mechanism
  applies tp-allreduce's hooks (``integrations.sglang.register_hooks``) in
  every process that calls ``load_plugins()``; the only patch here makes
  the processes that never call it (``sglang.bench_one_batch``, scripts
  that drive ``parallel_state`` directly) call it before their first
  ``GroupCoordinator`` is built (``PLUGIN_ERA_PATCHES``).
* Older SGLang: the four patches themselves (``PATCHES``)."""

import importlib.abc
import logging
import sys

from .integrations.sglang import PATCHES, PLUGIN_ERA_PATCHES, has_plugin_system

logger = logging.getLogger("tp_allreduce")


class _PatchAfterExec(importlib.abc.Loader):
    def __init__(self, loader, name, apply):
        self._loader = loader
        self._name = name
        self._apply = apply

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            self._apply(module)
        except Exception as e:  # never break SGLang's import
            logger.warning("tp-allreduce: patching %s failed: %s", self._name, e)


class PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds SGLang's module with the other finders and wraps its loader."""

    def __init__(self, patches):
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchAfterExec(spec.loader, fullname, self.patches[fullname])
                return spec
        return None


def watch(patches) -> None:
    """Applies ``patches`` (module name -> function of the module) when each
    module is imported, or now if it already is. Idempotent per dict."""
    if any(isinstance(f, PatchingFinder) and f.patches is patches for f in sys.meta_path):
        return
    sys.meta_path.insert(0, PatchingFinder(patches))
    for name, apply in patches.items():
        already = sys.modules.get(name)
        if already is not None:
            apply(already)


def PatchingFinder_for(fullname, path, target=None):  # noqa: N802 (names the class it asks)
    """The spec of ``fullname`` from the installed finders (the boot
    trigger hands over the import that woke it)."""
    for finder in sys.meta_path:
        if isinstance(finder, PatchingFinder):
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
    return None


def install() -> None:
    """Idempotent."""
    watch(PLUGIN_ERA_PATCHES if has_plugin_system() else PATCHES)

