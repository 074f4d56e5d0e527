"""Shared test switches (imported by the tests; not a conftest so that the
GPU harness can import it too).

Tests that need PyTorch or GPUs call ``require(...)``: without them they
skip visibly (``pytest -rs`` lists the reason); with
``TP_ALLREDUCE_REQUIRE_GPU=1`` (set on the GPU machine) the same condition
fails the test instead, so a GPU run cannot pass by skipping. A test that
does not apply to the machine at all (one for machines without a CUDA
driver, on a machine with one; an engine that is not installed) skips with
``not_applicable(...)``; under ``TP_ALLREDUCE_REQUIRE_GPU=1`` every other
skip, however raised, fails (``conftest.py``).
"""

import importlib.util
import os

import pytest

REQUIRE_GPU = os.environ.get("TP_ALLREDUCE_REQUIRE_GPU", "").strip() == "1"
# Starts the reason of every skip that TP_ALLREDUCE_REQUIRE_GPU=1 allows.
NOT_APPLICABLE = "not applicable here: "


def require(condition: bool, reason: str) -> None:
    """Skip (or, with TP_ALLREDUCE_REQUIRE_GPU=1, fail) unless ``condition``."""
    if condition:
        return
    if REQUIRE_GPU:
        pytest.fail(f"TP_ALLREDUCE_REQUIRE_GPU=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def not_applicable(reason: str) -> None:
    """Skip a test that has nothing to check on this machine (allowed under
    TP_ALLREDUCE_REQUIRE_GPU=1, and still listed by ``pytest -rs``)."""
    pytest.skip(NOT_APPLICABLE + reason)


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def cuda_device_count() -> int:
    """Visible CUDA devices according to PyTorch (0 without torch)."""
    if not has_module("torch"):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
