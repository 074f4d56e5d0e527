"""vLLM adapter: a general plugin (entry point group ``vllm.general_plugins``,
name ``tp_allreduce``), which vLLM runs in every engine and worker process.

With ``TP_ALLREDUCE_VLLM=1`` (``_tp_allreduce_boot.vllm_plugin`` reads it and
calls ``load_general_plugin``) it installs tp-allreduce into vLLM's own
``CudaCommunicator`` when vLLM imports it (``_classes.install``: the class's
``__init__`` wrapped in place, so the groups where vLLM builds a custom
allreduce, the tensor-parallel group, get tp-allreduce as ``ca_comm``), and
under ``TP_ALLREDUCE_VLLM_OVER_FLASHINFER=1`` wraps vLLM's
``CudaPlatform.check_and_update_config`` to turn off the AR+RMSNorm fusion
pass. No platform plugin: vLLM's own CUDA platform stays the platform, so
any other out-of-tree platform plugin keeps working.

Ray (``--distributed-executor-backend ray``): vLLM copies to its Ray actors
only the environment variables it knows and those with its prefixes; the
plugin adds ``TP_ALLREDUCE_`` to ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY``
in the process that starts them, so the switch and every ``TP_ALLREDUCE_*``
knob reach the workers.

If tp-allreduce cannot start on a group, vLLM's own custom allreduce (or
NCCL) stays in place.
"""

import logging
import os

logger = logging.getLogger("tp_allreduce")

ENV_SWITCH = "TP_ALLREDUCE_VLLM"
COMMUNICATOR_MODULE = "vllm.distributed.device_communicators.cuda_communicator"
PLATFORM_MODULE = "vllm.platforms.cuda"
RAY_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
OUR_PREFIX = "TP_ALLREDUCE_"

__all__ = ["enabled", "load_general_plugin", "forward_to_ray", "ENV_SWITCH", "PATCHES"]


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip() == "1"


def forward_to_ray() -> None:
    """Adds ``TP_ALLREDUCE_`` to vLLM's list of extra prefixes copied to Ray
    actors (read by vLLM when it starts them)."""
    have = [p.strip() for p in os.environ.get(RAY_PREFIXES, "").split(",") if p.strip()]
    if OUR_PREFIX not in have:
        os.environ[RAY_PREFIXES] = ",".join(have + [OUR_PREFIX])


def _patch_communicator(module) -> bool:
    from ._classes import install
    from .communicator import VllmTopologyCustomAllreduce

    install(module.CudaCommunicator, VllmTopologyCustomAllreduce)
    return True


def _patch_platform(module) -> bool:
    from ._classes import install_platform

    install_platform(module.CudaPlatform)
    return True


PATCHES = {COMMUNICATOR_MODULE: _patch_communicator, PLATFORM_MODULE: _patch_platform}


def load_general_plugin() -> None:
    """The plugin's work (idempotent): Ray forwarding, and the patches
    applied as soon as vLLM imports their modules (or now)."""
    from ..._sglang_hook import watch

    forward_to_ray()
    watch(PATCHES)
