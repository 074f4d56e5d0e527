"""Stand-ins for the dry run on a machine without a GPU (``run_checks
--dry-run``), never used on the GPU machine.

* ``pretend_cuda()``: torch reports one H200 (sm_90), so the engines'
  CUDA-gated imports (``is_cuda()`` at module level) happen as on the GPU
  machine. Only the queries listed here answer; nothing runs on a device
  (no kernel, no allocation: a module that allocates on CUDA at import
  fails the dry run, as it should be looked at).
* ``pretend_nvml()``: vLLM's platform detection (``cuda_platform_plugin``,
  ``vllm.platforms.cuda``) sees one GPU through NVML, so the platform
  resolution (vLLM's ``CudaPlatform`` or tp-allreduce's plugin) is the GPU
  machine's. The functions listed answer for one H200; any other NVML call
  raises ``NVMLError``.
"""

import types

GPU_NAME = "NVIDIA H200"
CAPABILITY = (9, 0)
MEMORY = 143771 << 20


def pretend_cuda():
    import torch

    class Properties:
        name = GPU_NAME
        major, minor = CAPABILITY
        total_memory = MEMORY
        multi_processor_count = 132
        L2_cache_size = 60 << 20
        gcnArchName = ""
        uuid = "GPU-00000000-0000-0000-0000-000000000000"
        warp_size = 32
        regs_per_multiprocessor = 65536
        max_threads_per_multi_processor = 2048
        shared_memory_per_block_optin = 227 << 10

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *a, **k: CAPABILITY
    torch.cuda.get_device_name = lambda *a, **k: GPU_NAME
    torch.cuda.get_device_properties = lambda *a, **k: Properties()
    torch.cuda.mem_get_info = lambda *a, **k: (MEMORY - (1 << 30), MEMORY)
    torch.cuda.is_bf16_supported = lambda *a, **k: True


class NVMLError(Exception):
    pass


def _fake_pynvml():
    m = types.ModuleType("pynvml_stand_in")
    m.NVMLError = NVMLError
    m.NVML_P2P_CAPS_INDEX_NVLINK = 3
    m.NVML_P2P_STATUS_OK = 0
    m.NVML_P2P_STATUS_NOT_SUPPORTED = 5

    class Handle:
        def __init__(self, index):
            self.index = index

    class Memory:
        total = MEMORY
        free = MEMORY - (1 << 30)
        used = 1 << 30

    m.nvmlInit = lambda *a: None
    m.nvmlShutdown = lambda *a: None
    m.nvmlDeviceGetCount = lambda: 1

    def handle(index):
        if index != 0:
            raise NVMLError(f"stand-in NVML has one GPU, not index {index}")
        return Handle(index)

    m.nvmlDeviceGetHandleByIndex = handle
    m.nvmlDeviceGetCudaComputeCapability = lambda h: CAPABILITY
    m.nvmlDeviceGetName = lambda h: GPU_NAME
    m.nvmlDeviceGetMemoryInfo = lambda h: Memory()
    m.nvmlDeviceGetUUID = lambda h: "GPU-00000000-0000-0000-0000-000000000000"

    def p2p(a, b, index):
        return m.NVML_P2P_STATUS_NOT_SUPPORTED

    m.nvmlDeviceGetP2PStatus = p2p

    def other(name):
        if name.startswith("__"):  # module protocol lookups (__file__, __path__, ...)
            raise AttributeError(name)

        def raiser(*a, **k):
            raise NVMLError(f"{name}: not answered by the dry run's NVML stand-in")

        return raiser

    m.__getattr__ = other
    return m


def pretend_nvml():
    """vLLM's ``import_pynvml`` returns the stand-in (patched before vLLM's
    platform modules bind it)."""
    import vllm.utils.import_utils as iu

    fake = _fake_pynvml()
    iu.import_pynvml = lambda: fake
    return fake
