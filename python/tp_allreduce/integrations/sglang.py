"""SGLang adapter.

SGLang's ``GroupCoordinator`` builds its custom allreduce as
``dispatch_custom_allreduce(...)(group=cpu_group, device=device)`` (module
``sglang.srt.distributed.device_communicators.custom_all_reduce``; older
versions call ``dispatch_custom_allreduce()`` without arguments). ``patch``
replaces that function so it returns tp-allreduce's class; nothing of
SGLang is edited. Activation:

* ``python -m tp_allreduce.sglang <sglang.launch_server arguments>``, or
* ``TP_ALLREDUCE_SGLANG=1`` in the environment of any SGLang command: the
  ``tp_allreduce_sglang.pth`` file the wheel installs into site-packages
  applies the patches in every Python process (SGLang's workers included)
  as soon as SGLang's modules are imported.

What is patched (checked against SGLang 0.5.23, see python/engine_checks):

* ``custom_all_reduce.dispatch_custom_allreduce``: tp-allreduce's class.
  Where SGLang itself would pick ``CustomAllReduceV2`` (CUDA, NVLink), the
  class is a subclass of SGLang's V2 that builds V2 as SGLang would (its
  push planes serve the V2-only fusions, which test
  ``isinstance(ca_comm, CustomAllReduceV2)``) and sends the plain
  allreduce (and the fused one) through tp-allreduce.
* ``flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm`` (the
  layer norm's fused allreduce + residual + RMSNorm on CUDA; SGLang calls
  ``ca_comm.fused_allreduce_rmsnorm`` only on ROCm): on groups that run
  tp-allreduce it runs tp-allreduce's fused kernel.
* ``layer_boundary.residual.add_norm.flashinfer_ar_fusion_applies`` (the
  gate of that fusion, which SGLang enables for FlashInfer on sm90/sm100
  only): also true where the tensor-parallel groups run tp-allreduce (any
  GPU, sm_120 included). ``TP_ALLREDUCE_SGLANG_FUSION=0`` turns both
  fusion patches off.
* ``parallel_state.GroupCoordinator._all_gather_into_tensor``: SGLang
  reaches a communicator's custom all-gather only on ROCm; on groups that
  run tp-allreduce, with a Communicator that has ``all_gather``, the
  all-gather goes through it (SGLang's own rules otherwise).

Deterministic inference (``SGLANG_ENABLE_DETERMINISTIC_INFERENCE`` or
``SGLANG_USE_1STAGE_ALLREDUCE``, SGLang's own reading): tp-allreduce stays
on, every size through size-independent algorithms; the fusion stays off
(SGLang turns FlashInfer's off then too) and so does the custom all-gather
(SGLang's rule).

SGLang only builds a custom allreduce when it is enabled: do not pass
``--disable-custom-all-reduce``. If tp-allreduce cannot start on a group,
the adapter reports itself disabled (on every rank of the group) and SGLang
falls back to its default.
"""

import contextlib
import functools
import logging
import os

from ._adapter import DEFAULT_MAX_SIZE, CustomAllreduceAdapter

logger = logging.getLogger("tp_allreduce")

TARGET_MODULE = "sglang.srt.distributed.device_communicators.custom_all_reduce"
FUSION_MODULE = "sglang.srt.layers.flashinfer_comm_fusion"
ADD_NORM_MODULE = "sglang.srt.layers.layer_boundary.residual.add_norm"
PARALLEL_STATE_MODULE = "sglang.srt.distributed.parallel_state"
ENV_SWITCH = "TP_ALLREDUCE_SGLANG"
FUSION_SWITCH = "TP_ALLREDUCE_SGLANG_FUSION"
# SGLang's FUSE_ALLREDUCE_MAX_BATCH_SIZE (layer_boundary.residual.add_norm).
FUSION_MAX_TOKENS = 2048

__all__ = [
    "TpAllreduceCustomAllreduce",
    "dispatch_custom_allreduce",
    "patch",
    "patch_fusion",
    "patch_fusion_gate",
    "patch_parallel_state",
    "PATCHES",
    "ENV_SWITCH",
    "TARGET_MODULE",
]

_original_dispatch = {}  # module name -> SGLang's dispatcher
_v2_classes = {}  # id(SGLang's CustomAllReduceV2) -> our subclass


def deterministic() -> bool:
    """SGLang's ``GroupCoordinator._deterministic_collectives_enabled``
    where SGLang is importable, else the same reading of the environment."""
    try:
        from sglang.srt.distributed.parallel_state import GroupCoordinator

        return bool(GroupCoordinator._deterministic_collectives_enabled())
    except Exception:
        one_stage = os.environ.get("SGLANG_USE_1STAGE_ALLREDUCE")
        if one_stage is not None and one_stage.strip() != "":
            return one_stage.strip().lower() in ("1", "true", "yes", "y", "on")
        flag = os.environ.get("SGLANG_ENABLE_DETERMINISTIC_INFERENCE", "")
        return flag.strip().lower() in ("1", "true", "yes", "y", "on")


def fusion_enabled() -> bool:
    return os.environ.get(FUSION_SWITCH, "1").strip() != "0" and not deterministic()


class TpAllreduceCustomAllreduce(CustomAllreduceAdapter):
    """SGLang's ``CustomAllreduce`` surface backed by tp-allreduce."""

    engine = "sglang"

    def __init__(self, group, device, max_size=DEFAULT_MAX_SIZE, **options):
        options.setdefault("size_independent", deterministic())
        super().__init__(group, device, max_size, **options)

    # SGLang's custom all-gather surface (aiter's names and signature).
    def should_custom_ag(self, inp) -> bool:
        return self.gather_eligible(inp)

    def _gather_into(self, inp, out):
        got = self.gather_rows(inp)
        if got is None:
            raise RuntimeError("tp-allreduce: all-gather called on a tensor should_custom_ag refused")
        if got is not out:
            out.copy_(got.view(out.shape))
        return out

    def all_gather_reg(self, inp, out=None, dim=0):
        """All-gather along dimension 0 into ``out`` (captured calls; the
        library registers what it needs itself)."""
        return self._gather_into(inp, out)

    def all_gather_unreg(self, inp, out=None, dim=0):
        return self._gather_into(inp, out)

    def fused_allreduce_residual_rmsnorm(self, input, residual, weight, eps):  # noqa: A002
        """FlashInfer's contract (``flashinfer_allreduce_residual_rmsnorm``):
        ``(normed, residual_out)`` with ``residual_out`` a new tensor and the
        caller's ``residual`` left as it was (SGLang's layer boundary relies
        on it: ``flashinfer_preserves_residual``). ``None`` when not for us."""
        if self.disabled:
            return None
        # The fused plan (NCCL's or not) is asked by `fused_allreduce_rmsnorm`.
        if not self._eligible(input, nccl_check=False) or self._runtime.fused_ineligible(input, residual, weight) is not None:
            self.counters["fused_declined"] += 1
            return None
        return self.fused_allreduce_rmsnorm(input, self._runtime.clone(residual), weight, eps)


def _v2_class(v2):
    """Our subclass of SGLang's ``CustomAllReduceV2``: V2 is built as SGLang
    builds it (the V2-only fusions use its planes), the allreduce goes
    through tp-allreduce, V2 serves what tp-allreduce refuses."""
    cls = _v2_classes.get(id(v2))
    if cls is not None:
        return cls

    class TpAllreduceCustomAllReduceV2(v2):
        engine = "sglang"

        def __init__(self, group, device, *args, **kwargs):
            v2.__init__(self, group, device, *args, **kwargs)
            self._tpa = TpAllreduceCustomAllreduce(group=group, device=device)
            self.disabled_reason = self._tpa.disabled_reason

        def _ours(self):
            return not self.disabled and not self._tpa.disabled

        def should_custom_ar(self, inp):
            if self._ours() and self._tpa._eligible(inp):
                return True
            return v2.should_custom_ar(self, inp)

        def custom_all_reduce(self, input):  # noqa: A002
            if self._ours() and self._tpa._eligible(input):
                return self._tpa.custom_all_reduce(input)
            return v2.custom_all_reduce(self, input)

        def fused_allreduce_rmsnorm(self, input, residual, weight, eps):  # noqa: A002
            return self._tpa.fused_allreduce_rmsnorm(input, residual, weight, eps) if self._ours() else None

        def fused_allreduce_residual_rmsnorm(self, input, residual, weight, eps):  # noqa: A002
            return self._tpa.fused_allreduce_residual_rmsnorm(input, residual, weight, eps) if self._ours() else None

        @contextlib.contextmanager
        def capture(self):
            with v2.capture(self), self._tpa.capture():
                self._IS_CAPTURING = True
                try:
                    yield
                finally:
                    self._IS_CAPTURING = False

        def close(self):
            tpa = getattr(self, "_tpa", None)
            if tpa is not None:
                tpa.close()
            v2.close(self)

    TpAllreduceCustomAllReduceV2.__module__ = __name__
    _v2_classes[id(v2)] = TpAllreduceCustomAllReduceV2
    return TpAllreduceCustomAllReduceV2


def _is_sglang_v2(cls) -> bool:
    return isinstance(cls, type) and cls.__name__ == "CustomAllReduceV2"


def around_dispatch(original, *args, **kwargs):
    """Hook on SGLang's dispatcher (any signature; ``original`` SGLang's or
    None): our class, or our subclass of SGLang's V2 where SGLang's
    dispatcher picks V2."""
    if original is not None and (args or kwargs):
        try:
            theirs = original(*args, **kwargs)
        except Exception as e:  # SGLang's own choice failed: ours alone
            logger.info("tp-allreduce: SGLang's dispatcher raised %s; using tp-allreduce's class", e)
            theirs = None
        if _is_sglang_v2(theirs):
            return _v2_class(theirs)
    return TpAllreduceCustomAllreduce


def dispatch_custom_allreduce(*args, **kwargs):
    """Replacement for SGLang's dispatcher where ``patch`` installed it."""
    return around_dispatch(_original_dispatch.get(TARGET_MODULE), *args, **kwargs)


def patch(module) -> bool:
    """Points ``module.dispatch_custom_allreduce`` (SGLang's
    custom_all_reduce module) at ours; keeps the original as
    ``module._tp_allreduce_original_dispatch``. Returns False (and logs) when
    the module has no dispatcher to replace (an SGLang too old or too new)."""
    if getattr(module, "dispatch_custom_allreduce", None) is dispatch_custom_allreduce:
        return True
    if not hasattr(module, "dispatch_custom_allreduce"):
        logger.warning(
            "tp-allreduce: %s has no dispatch_custom_allreduce; this SGLang version is not supported, "
            "SGLang keeps its own allreduce",
            getattr(module, "__name__", module),
        )
        return False
    module._tp_allreduce_original_dispatch = module.dispatch_custom_allreduce
    _original_dispatch[TARGET_MODULE] = module.dispatch_custom_allreduce
    module.dispatch_custom_allreduce = dispatch_custom_allreduce
    logger.info("tp-allreduce: SGLang's custom allreduce is now tp-allreduce")
    return True


# ---------------------------------------------------------------- fusion
def _is_ours(ca) -> bool:
    if isinstance(ca, CustomAllreduceAdapter):
        return not ca.disabled
    tpa = getattr(ca, "_tpa", None)  # the V2 subclass
    return isinstance(tpa, CustomAllreduceAdapter) and not tpa.disabled and not ca.disabled


def _fusion_coordinator(use_attn_tp_group):
    """The group the fused call reduces over: SGLang's
    ``resolve_fusion_group`` (attention TP, or the post-experts group)."""
    from sglang.srt.layers.flashinfer_comm_fusion import resolve_fusion_group

    return resolve_fusion_group(use_attn_tp_group=use_attn_tp_group)[2]


FUSED_ENTRY_ARGS = (
    "input_tensor",
    "residual",
    "weight",
    "eps",
    "max_token_num",
    "use_oneshot",
    "trigger_completion_at_end",
    "fp32_acc",
    "use_attn_tp_group",
)


def around_fused_entry(original, *args, **kwargs):
    """Hook on SGLang's fused allreduce + residual + RMSNorm entry
    (``flashinfer_allreduce_residual_rmsnorm``): tp-allreduce's fused kernel
    on groups that run tp-allreduce, SGLang's (FlashInfer) otherwise. Same
    contract: ``(normed, residual_out)`` or ``(None, None)`` when declined
    (SGLang then reduces and normalises separately)."""
    if fusion_enabled():
        a = dict(zip(FUSED_ENTRY_ARGS, args))
        a.update(kwargs)
        try:
            ca = getattr(_fusion_coordinator(a.get("use_attn_tp_group", True)), "ca_comm", None)
        except Exception:
            ca = None
        if _is_ours(ca):
            out = ca.fused_allreduce_residual_rmsnorm(a["input_tensor"], a["residual"], a["weight"], a.get("eps", 1e-6))
            if out is not None:
                return out
    return original(*args, **kwargs)


def around_fusion_gate(original, batch_size):
    """Hook on the layer boundary's fusion gate (``flashinfer_ar_fusion_applies``)."""
    return original(batch_size) or ours_fusion_applies(batch_size)


def _legacy_wrap(original, hook):
    """``hook`` around ``original`` as one function (the ``.pth`` path, for
    SGLang without plugins); ``_tp_allreduce_original`` marks it."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return hook(original, *args, **kwargs)

    wrapper._tp_allreduce_original = original
    return wrapper


def _make_fused_entry(original):
    return _legacy_wrap(original, around_fused_entry)


def patch_fusion(module) -> bool:
    """Wraps ``module.flashinfer_allreduce_residual_rmsnorm`` (SGLang's
    ``flashinfer_comm_fusion``; the layer norm imports it at call time)."""
    current = getattr(module, "flashinfer_allreduce_residual_rmsnorm", None)
    if current is None:
        logger.warning("tp-allreduce: %s has no flashinfer_allreduce_residual_rmsnorm; no fused epilogue", module)
        return False
    if getattr(current, "_tp_allreduce_original", None) is not None:
        return True
    module.flashinfer_allreduce_residual_rmsnorm = _make_fused_entry(current)
    return True


def ours_fusion_applies(batch_size) -> bool:
    """Whether tp-allreduce takes the layer boundary's fused allreduce for a
    batch of ``batch_size`` tokens: fusion on, no attention DP, the TP and
    attention-TP groups on tp-allreduce, at most SGLang's fusion batch."""
    if not fusion_enabled() or not 0 < batch_size <= FUSION_MAX_TOKENS:
        return False
    try:
        from sglang.srt.distributed.parallel_state import get_attn_tp_group, get_tp_group
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled

        if is_dp_attention_enabled():
            return False
        return all(_is_ours(getattr(g, "ca_comm", None)) for g in (get_tp_group(), get_attn_tp_group()))
    except Exception:
        return False


def patch_fusion_gate(module) -> bool:
    """Wraps ``module.flashinfer_ar_fusion_applies`` (SGLang's
    ``layer_boundary.residual.add_norm``; ``exit`` and ``fusions.allreduce``
    import it by name after this module ran, so they get the wrapper)."""
    current = getattr(module, "flashinfer_ar_fusion_applies", None)
    if current is None:
        logger.warning("tp-allreduce: %s has no flashinfer_ar_fusion_applies; fusion not enabled for tp-allreduce", module)
        return False
    if getattr(current, "_tp_allreduce_original", None) is not None:
        return True

    module.flashinfer_ar_fusion_applies = _legacy_wrap(current, around_fusion_gate)
    return True


# ---------------------------------------------------------------- all-gather
def patch_parallel_state(module) -> bool:
    """Wraps ``GroupCoordinator._all_gather_into_tensor`` so that groups on
    tp-allreduce gather through it (SGLang's CUDA path never asks the
    custom allreduce; its ROCm path does, with the same methods)."""
    gc = getattr(module, "GroupCoordinator", None)
    current = getattr(gc, "_all_gather_into_tensor", None)
    if current is None:
        logger.warning("tp-allreduce: %s has no GroupCoordinator._all_gather_into_tensor", module)
        return False
    if getattr(current, "_tp_allreduce_original", None) is not None:
        return True

    gc._all_gather_into_tensor = _legacy_wrap(current, around_all_gather)
    return True


def around_all_gather(original, self, output, input):  # noqa: A002 (SGLang's names)
    """Hook on ``GroupCoordinator._all_gather_into_tensor``: groups on
    tp-allreduce gather through it (SGLang's CUDA path never asks the custom
    allreduce; its ROCm path does, with the same methods)."""
    ca = self.ca_comm
    if (
        _is_ours(ca)
        and not deterministic()
        and hasattr(ca, "should_custom_ag")
        and input.is_contiguous()
        and output.is_contiguous()
        and ca.should_custom_ag(input)
    ):
        ca.all_gather_unreg(input, out=output, dim=0)
        return
    original(self, output, input)


# module name -> patch function; the import hook applies each when SGLang
# imports the module (or at once if it already is).
PATCHES = {
    TARGET_MODULE: patch,
    FUSION_MODULE: patch_fusion,
    ADD_NORM_MODULE: patch_fusion_gate,
    PARALLEL_STATE_MODULE: patch_parallel_state,
}


# ---------------------------------------------------------------- SGLang's plugins
# SGLang >= 0.5.23: the same hooks registered with SGLang's HookRegistry by
# the general plugin (entry point group ``sglang.srt.plugins``, name
# ``tp_allreduce``); SGLang applies them in every process that runs
# ``load_plugins()`` (launch_server, the engine, each scheduler, the DP
# controller, the detokenizer), and its ``apply_hooks`` also rebinds the
# names other modules imported by value before.
PLUGIN_NAME = "tp_allreduce"
HOOKS = {
    TARGET_MODULE + ".dispatch_custom_allreduce": around_dispatch,
    FUSION_MODULE + ".flashinfer_allreduce_residual_rmsnorm": around_fused_entry,
    ADD_NORM_MODULE + ".flashinfer_ar_fusion_applies": around_fusion_gate,
    PARALLEL_STATE_MODULE + ".GroupCoordinator._all_gather_into_tensor": around_all_gather,
}
_hooks_registered = False


def register_hooks() -> None:
    """Registers ``HOOKS`` (AROUND) with SGLang's HookRegistry, once per
    process. Called by the plugin when ``TP_ALLREDUCE_SGLANG=1``."""
    global _hooks_registered
    if _hooks_registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in HOOKS.items():
        HookRegistry.register(target, hook, HookType.AROUND)
    _hooks_registered = True
    logger.info("tp-allreduce: SGLang hooks registered (%d targets)", len(HOOKS))


def hooks_applied():
    """Per target of ``HOOKS``: how it is hooked in this process
    (``"plugin"``: applied by SGLang's HookRegistry; ``"pth"``: patched at
    import by the .pth path) or ``None``."""
    import pkgutil

    out = {}
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry

        registry = HookRegistry
    except Exception:
        registry = None
    for target, hook in HOOKS.items():
        how = None
        if registry is not None and target in registry._patched:
            if any(h is hook for _, h, _ in registry._hooks.get(target, ())):
                how = "plugin"
        if how is None:
            owner, _, attr = target.rpartition(".")
            try:
                current = getattr(pkgutil.resolve_name(owner), attr)
            except Exception:
                current = None
            if getattr(current, "_tp_allreduce_original", None) is not None:
                how = "pth"
        out[target] = how
    return out


def patch_load_plugins_trigger(module) -> bool:
    """The ``.pth`` path on SGLang with plugins: wraps
    ``GroupCoordinator.__init__`` (``module``: SGLang's parallel_state) so
    that SGLang's ``load_plugins()`` (idempotent) has run before any group
    builds its custom allreduce. SGLang's servers call it themselves; this
    reaches the processes that never do (``sglang.bench_one_batch``,
    scripts and tests that drive ``parallel_state`` directly)."""
    gc = getattr(module, "GroupCoordinator", None)
    current = getattr(gc, "__init__", None)
    if current is None:
        return False
    if getattr(current, "_tp_allreduce_original", None) is not None:
        return True

    def around_init(original, self, *args, **kwargs):
        try:
            from sglang.srt.plugins import load_plugins

            load_plugins()
        except Exception as e:
            logger.warning("tp-allreduce: SGLang's load_plugins() failed: %s", e)
        return original(self, *args, **kwargs)

    gc.__init__ = _legacy_wrap(current, around_init)
    return True


def has_plugin_system() -> bool:
    """Whether the installed SGLang has ``sglang.srt.plugins`` (0.5.23 and
    newer), found without importing SGLang."""
    import importlib.util
    import sys

    if "sglang.srt.plugins.hook_registry" in sys.modules:
        return True
    try:
        spec = importlib.util.find_spec("sglang")
    except Exception:
        return False
    for d in (spec.submodule_search_locations or []) if spec is not None else []:
        if os.path.exists(os.path.join(d, "srt", "plugins", "hook_registry.py")):
            return True
    return False


# The .pth path on SGLang with plugins: only the trigger above.
PLUGIN_ERA_PATCHES = {PARALLEL_STATE_MODULE: patch_load_plugins_trigger}
