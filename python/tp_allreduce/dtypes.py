"""Element types: the names tp-allreduce accepts and their codes in the raw
API. Works on anything whose ``str()`` is a dtype name (``torch.bfloat16``
prints as ``torch.bfloat16``), so it needs no PyTorch."""

from . import _core
from .errors import Unsupported

F32 = _core.DTYPE_F32
F16 = _core.DTYPE_F16
BF16 = _core.DTYPE_BF16

# Accepted spellings (after dropping a "torch." prefix) -> code.
_CODES = {
    "float32": F32,
    "float": F32,
    "f32": F32,
    "float16": F16,
    "half": F16,
    "f16": F16,
    "bfloat16": BF16,
    "bf16": BF16,
}

SUPPORTED = ("float32", "float16", "bfloat16")


def code_of(dtype) -> int:
    """The raw-API code of ``dtype`` (a ``torch.dtype`` or a name); raises
    ``Unsupported`` for any other type (sum of integers, float64, fp8...)."""
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch.") :]
    try:
        return _CODES[name]
    except KeyError:
        raise Unsupported(
            f"dtype {dtype} is not supported: tp-allreduce reduces {', '.join(SUPPORTED)} "
            "(accumulating in float32); use torch.distributed for other types"
        ) from None


def size_of(code: int) -> int:
    """Bytes per element of a dtype code (raises ``InvalidUsage`` for unknown codes)."""
    return _core.dtype_size(code)


def name_of(code: int) -> str:
    """Short name (``f32``, ``f16``, ``bf16``) of a dtype code."""
    return _core.dtype_name(code)
