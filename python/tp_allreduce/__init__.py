"""tp-allreduce from Python.

* ``tp_allreduce.Communicator`` / ``tp_allreduce.Id`` — the torch-free core:
  one rank of a communicator driven with raw device pointers and stream
  handles (``tp_allreduce._core``); ``PreparedRank`` splits its creation
  into the rank's own setup and the collective join.
* ``tp_allreduce.torch`` — the PyTorch API: ``Communicator.from_group(group,
  device)``, ``all_reduce(t, out=None)``, ``all_reduce_(t)``, ``capture()``.
* ``tp_allreduce.integrations.sglang`` / ``.vllm`` — engine adapters
  (``python -m tp_allreduce.sglang ...``; ``TP_ALLREDUCE_VLLM=1``).
* ``tp_allreduce.errors`` — the exception classes.

The library logs through Python's ``logging`` under ``tp_allreduce`` (one
INFO line per communicator at creation, a WARNING whenever a slower path is
taken): ``logging.getLogger("tp_allreduce")`` configures it.
"""

from . import dtypes, errors
from ._core import (
    DEFAULT_CAPTURE_COPY_BYTES,
    Communicator,
    Id,
    PreparedRank,
    __version__,
    check_call_args,
    driver_available,
    pointer_is_ipc_exportable,
)
from .errors import *  # noqa: F401,F403 (the exception classes are part of the top-level API)

__all__ = [
    "Communicator",
    "Id",
    "PreparedRank",
    "DEFAULT_CAPTURE_COPY_BYTES",
    "check_call_args",
    "driver_available",
    "pointer_is_ipc_exportable",
    "dtypes",
    "errors",
    "__version__",
] + errors.__all__
