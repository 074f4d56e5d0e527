"""The vLLM classes, built by subclassing whatever base vLLM provides (so
this module imports neither vLLM nor PyTorch and is tested with fake
bases)."""

import logging

from .._adapter import DEFAULT_MAX_SIZE, CustomAllreduceAdapter

logger = logging.getLogger("tp_allreduce")


class TpAllreduceVllmCustomAllreduce(CustomAllreduceAdapter):
    """vLLM's ``CustomAllreduce`` surface (``group, device, max_size``;
    vLLM-only keyword arguments such as ``symm_mem_enabled`` are accepted
    and ignored) backed by tp-allreduce."""

    engine = "vllm"

    def __init__(self, group, device, max_size=DEFAULT_MAX_SIZE, **options):
        super().__init__(group, device, max_size, **options)


def _name(cls, module, name):
    cls.__module__ = module
    cls.__name__ = cls.__qualname__ = name
    return cls


def make_communicator_class(base, adapter_cls=TpAllreduceVllmCustomAllreduce, module=__name__):
    """A subclass of vLLM's ``CudaCommunicator`` (``base``) whose ``ca_comm``
    is tp-allreduce wherever vLLM would build a custom allreduce."""

    class TpAllreduceCudaCommunicator(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._install_tp_allreduce()

        def _install_tp_allreduce(self):
            wanted = getattr(self, "use_custom_allreduce", None)
            if wanted is None:  # attribute renamed: vLLM's rule is "tp groups only"
                wanted = "tp" in getattr(self, "unique_name", "")
            if not wanted or getattr(self, "world_size", 1) <= 1:
                return
            ours = adapter_cls(group=self.cpu_group, device=self.device)
            if ours.disabled:
                return  # vLLM's own custom allreduce (or NCCL) stays
            theirs = getattr(self, "ca_comm", None)
            self.ca_comm = ours
            if theirs is not None and hasattr(theirs, "close"):
                try:
                    theirs.close()
                except Exception as e:
                    logger.warning("tp-allreduce: closing vLLM's custom allreduce failed: %s", e)

        def destroy(self):
            ca = getattr(self, "ca_comm", None)
            if isinstance(ca, CustomAllreduceAdapter):
                ca.close()
            parent = getattr(super(), "destroy", None)
            if parent is not None:
                parent()

    return _name(TpAllreduceCudaCommunicator, module, "TpAllreduceCudaCommunicator")


def make_platform_class(base, communicator_qualname, module=__name__):
    """A subclass of vLLM's CUDA platform (``base``) whose device
    communicator is ``communicator_qualname``."""

    class TpAllreduceCudaPlatform(base):
        @classmethod
        def get_device_communicator_cls(cls) -> str:
            return communicator_qualname

    return _name(TpAllreduceCudaPlatform, module, "TpAllreduceCudaPlatform")
