"""The adapter with vLLM's own NVLink test (imports vLLM and PyTorch).
tp-allreduce goes into vLLM's own ``CudaCommunicator``
(``_classes.install``, applied by the general plugin when vLLM imports that
class), so ``device_comm_cls == CudaCommunicator`` holds (vLLM's elastic-EP
coordinator asserts it)."""

from ._classes import TpAllreduceVllmCustomAllreduce, _vllm_fully_connected


class VllmTopologyCustomAllreduce(TpAllreduceVllmCustomAllreduce):
    """The adapter with vLLM's own NVLink test for ``fully_connected``."""

    def __init__(self, group, device, **options):
        super().__init__(group, device, fully_connected_fn=_vllm_fully_connected, **options)
