"""dtype mapping without PyTorch: anything whose str() is a dtype name."""

import pytest
from tp_allreduce import _core, dtypes, errors


class FakeTorchDtype:
    """Prints like a torch.dtype."""

    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


@pytest.mark.parametrize(
    "dtype, code",
    [
        (FakeTorchDtype("float32"), dtypes.F32),
        (FakeTorchDtype("float16"), dtypes.F16),
        (FakeTorchDtype("bfloat16"), dtypes.BF16),
        ("float32", dtypes.F32),
        ("half", dtypes.F16),
        ("bf16", dtypes.BF16),
    ],
)
def test_supported_dtypes_map_to_their_codes(dtype, code):
    assert dtypes.code_of(dtype) == code


@pytest.mark.parametrize("name", ["float64", "int32", "int8", "float8_e4m3fn", "bool", "complex64"])
def test_other_dtypes_raise_unsupported_naming_the_alternatives(name):
    with pytest.raises(errors.Unsupported) as info:
        dtypes.code_of(FakeTorchDtype(name))
    message = str(info.value)
    assert f"torch.{name}" in message
    assert "float32, float16, bfloat16" in message


def test_sizes_and_names_come_from_the_library():
    for name, size in [("float32", 4), ("float16", 2), ("bfloat16", 2)]:
        code = dtypes.code_of(name)
        assert dtypes.size_of(code) == size == _core.dtype_size(code)
    assert [dtypes.name_of(c) for c in (dtypes.F32, dtypes.F16, dtypes.BF16)] == ["f32", "f16", "bf16"]
    with pytest.raises(errors.InvalidUsage):
        dtypes.size_of(9)
