"""vLLM's CUDA platform with tp-allreduce's device communicator (imports vLLM)."""

from vllm.platforms.cuda import CudaPlatform

from . import COMMUNICATOR_QUALNAME
from ._classes import make_platform_class

TpAllreduceCudaPlatform = make_platform_class(CudaPlatform, COMMUNICATOR_QUALNAME, module=__name__)
