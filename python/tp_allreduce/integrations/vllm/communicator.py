"""vLLM's CUDA device communicator with tp-allreduce as custom allreduce (imports vLLM)."""

from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

from ._classes import make_communicator_class

TpAllreduceCudaCommunicator = make_communicator_class(CudaCommunicator, module=__name__)
