"""vLLM adapter: an out-of-tree platform plugin.

vLLM calls every function registered under the entry-point group
``vllm.platform_plugins`` in each process; ``register`` returns ``None``
(inactive) unless ``TP_ALLREDUCE_VLLM=1``, and otherwise the name of a
platform class that is vLLM's CUDA platform with one change: its device
communicator puts tp-allreduce in the place of vLLM's custom allreduce for
the groups where vLLM would use one (the tensor-parallel group). vLLM
accepts one active out-of-tree platform plugin at a time.

If tp-allreduce cannot start on a group, vLLM's own custom allreduce (or
NCCL) stays in place.
"""

import os

ENV_SWITCH = "TP_ALLREDUCE_VLLM"
PLATFORM_QUALNAME = "tp_allreduce.integrations.vllm.platform.TpAllreduceCudaPlatform"
COMMUNICATOR_QUALNAME = "tp_allreduce.integrations.vllm.communicator.TpAllreduceCudaCommunicator"

__all__ = ["register", "enabled", "ENV_SWITCH", "PLATFORM_QUALNAME", "COMMUNICATOR_QUALNAME"]


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip() == "1"


def register():
    """vLLM platform-plugin entry point: the platform's qualified name when
    TP_ALLREDUCE_VLLM=1, else ``None``. Imports nothing of vLLM."""
    return PLATFORM_QUALNAME if enabled() else None
