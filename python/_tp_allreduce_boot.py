"""tp-allreduce's entry points into other programs, each guarded so that a
broken install costs a process one WARNING line and never a traceback.

Installed at the top of site-packages beside ``tp_allreduce_sglang.pth``
(which Python runs in every process of the environment at start) and
named by the wheel's entry points:

* ``pth()``: the ``.pth`` line calls it when ``TP_ALLREDUCE_SGLANG=1``;
* ``sglang_plugin()``: entry point group ``sglang.srt.plugins`` (SGLang
  >= 0.5.23 runs it in launch_server, the engine and every scheduler);
* ``vllm_plugin()``: entry point group ``vllm.general_plugins`` (every vLLM
  engine and worker process).

Nothing here imports ``tp_allreduce`` (its native library) unless the
switch of that engine is on, and the ``.pth`` path not before SGLang
itself is imported: with the switch off the cost to an unrelated process
is reading one environment variable, with it on importing this module and
one finder that answers "not mine" to every other import.
"""

import os
import sys

# Modules whose import means SGLang's distributed layer is in use (the
# patched ones of tp_allreduce.integrations.sglang.PATCHES).
_SGLANG_TRIGGERS = frozenset(
    (
        "sglang.srt.distributed.parallel_state",
        "sglang.srt.distributed.device_communicators.custom_all_reduce",
        "sglang.srt.layers.flashinfer_comm_fusion",
        "sglang.srt.layers.layer_boundary.residual.add_norm",
    )
)

_warned = False


def _warn_once(what, exc):
    """One line on stderr per process, naming the fix."""
    global _warned
    if _warned:
        return
    _warned = True
    try:
        detail = f"{type(exc).__name__}: {exc}".splitlines()[0]
        sys.stderr.write(
            f"WARNING tp-allreduce: {what} is set but tp-allreduce could not be loaded in this process "
            f"({detail}); the engine runs with its own allreduce. Fix: reinstall tp-allreduce's wheel for "
            f"this machine into this environment (pip install --force-reinstall <wheel>), or unset {what}.\n"
        )
    except Exception:  # stderr closed: nothing left to tell
        pass


def _on(name):
    return os.environ.get(name, "").strip() == "1"


class _SglangTrigger:
    """A meta-path finder (not derived from ``importlib.abc``: importing that
    costs every process ~20 ms) that waits for SGLang's distributed layer to
    be imported, then installs ``tp_allreduce._sglang_hook`` (and hands it
    that import)."""

    def __init__(self):
        self._busy = False

    def find_spec(self, fullname, path, target=None):
        if fullname not in _SGLANG_TRIGGERS or self._busy:
            return None
        self._busy = True
        try:
            try:
                sys.meta_path.remove(self)
            except ValueError:
                # Another thread's import got here first and installed the hook.
                return None
            hook = _install_sglang_hook()
            return None if hook is None else hook.PatchingFinder_for(fullname, path, target)
        except Exception as e:  # never break the program's own import
            _warn_once("TP_ALLREDUCE_SGLANG=1", e)
            return None
        finally:
            self._busy = False


def _install_sglang_hook():
    try:
        from tp_allreduce import _sglang_hook

        _sglang_hook.install()
        return _sglang_hook
    except BaseException as e:  # noqa: BLE001 (never break the importing program)
        _warn_once("TP_ALLREDUCE_SGLANG=1", e)
        return None


def pth():
    """``tp_allreduce_sglang.pth``: the SGLang patches of processes that
    never load SGLang's plugins (``tp_allreduce._sglang_hook``), installed
    when SGLang's distributed layer is first imported (at once if it
    already is)."""
    if not _on("TP_ALLREDUCE_SGLANG"):
        return
    try:
        if any(name in sys.modules for name in _SGLANG_TRIGGERS):
            _install_sglang_hook()
        else:
            sys.meta_path.insert(0, _SglangTrigger())
    except BaseException as e:  # noqa: BLE001 (interpreter start must not fail)
        _warn_once("TP_ALLREDUCE_SGLANG=1", e)


def sglang_plugin():
    """SGLang general plugin: registers tp-allreduce's hooks with SGLang's
    ``HookRegistry`` when ``TP_ALLREDUCE_SGLANG=1`` (SGLang applies them)."""
    if not _on("TP_ALLREDUCE_SGLANG"):
        return
    try:
        from tp_allreduce.integrations import sglang

        sglang.register_hooks()
    except Exception as e:
        _warn_once("TP_ALLREDUCE_SGLANG=1", e)


def vllm_plugin():
    """vLLM general plugin: installs tp-allreduce into vLLM's
    ``CudaCommunicator`` when ``TP_ALLREDUCE_VLLM=1``."""
    if not _on("TP_ALLREDUCE_VLLM"):
        return
    try:
        from tp_allreduce.integrations import vllm

        vllm.load_general_plugin()
    except Exception as e:
        _warn_once("TP_ALLREDUCE_VLLM=1", e)
