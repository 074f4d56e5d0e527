"""vLLM's own ``CudaCommunicator`` with tp-allreduce installed (imports
vLLM). ``TpAllreduceCudaCommunicator`` *is* vLLM's class (the same object),
so the plugin's qualified name resolves to it and ``device_comm_cls ==
CudaCommunicator`` holds (vLLM's elastic-EP coordinator asserts it).
Installed when vLLM first resolves the device communicator (after the
platform is resolved: importing vLLM's module earlier would re-enter the
platform resolution)."""

from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

from ._classes import TpAllreduceVllmCustomAllreduce, _vllm_fully_connected, install


class VllmTopologyCustomAllreduce(TpAllreduceVllmCustomAllreduce):
    """The adapter with vLLM's own NVLink test for ``fully_connected``."""

    def __init__(self, group, device, **options):
        super().__init__(group, device, fully_connected_fn=_vllm_fully_connected, **options)


TpAllreduceCudaCommunicator = install(CudaCommunicator, VllmTopologyCustomAllreduce)
