"""SGLang adapter.

SGLang's ``GroupCoordinator`` builds its custom allreduce as
``dispatch_custom_allreduce(...)(group=cpu_group, device=device)`` (module
``sglang.srt.distributed.device_communicators.custom_all_reduce``; older
versions call ``dispatch_custom_allreduce()`` without arguments). ``patch``
replaces that function so it returns ``TpAllreduceCustomAllreduce``;
nothing of SGLang is edited. Activation:

* ``python -m tp_allreduce.sglang <sglang.launch_server arguments>``, or
* ``TP_ALLREDUCE_SGLANG=1`` in the environment of any SGLang command: the
  ``tp_allreduce_sglang.pth`` file the wheel installs into site-packages
  applies the patch in every Python process (SGLang's workers included) as
  soon as SGLang's module is imported.

SGLang only builds a custom allreduce when it is enabled: do not pass
``--disable-custom-all-reduce``. If tp-allreduce cannot start on a group,
the adapter reports itself disabled (on every rank of the group) and SGLang
falls back to NCCL.
"""

import logging

from ._adapter import DEFAULT_MAX_SIZE, CustomAllreduceAdapter

logger = logging.getLogger("tp_allreduce")

TARGET_MODULE = "sglang.srt.distributed.device_communicators.custom_all_reduce"
ENV_SWITCH = "TP_ALLREDUCE_SGLANG"

__all__ = ["TpAllreduceCustomAllreduce", "dispatch_custom_allreduce", "patch", "ENV_SWITCH", "TARGET_MODULE"]


class TpAllreduceCustomAllreduce(CustomAllreduceAdapter):
    """SGLang's ``CustomAllreduce`` surface backed by tp-allreduce."""

    engine = "sglang"

    def __init__(self, group, device, max_size=DEFAULT_MAX_SIZE, **options):
        super().__init__(group, device, max_size, **options)


def dispatch_custom_allreduce(*_args, **_kwargs):
    """Replacement for SGLang's dispatcher (any signature): our class."""
    return TpAllreduceCustomAllreduce


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
    module.dispatch_custom_allreduce = dispatch_custom_allreduce
    logger.info("tp-allreduce: SGLang's custom allreduce is now tp-allreduce")
    return True
