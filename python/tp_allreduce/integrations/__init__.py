"""Engine adapters: ``sglang`` (patches SGLang's custom-allreduce dispatch)
and ``vllm`` (a general plugin). Importing this package imports neither
engine nor PyTorch.

``counters()``: the calls per path (``ours``, ``declined``, ``fused``,
``fused_declined``, ``all_gather``, ``reduce_scatter``) of this process's
enabled adapters, to confirm what goes through tp-allreduce."""

from ._adapter import COUNTER_KEYS, counters

__all__ = ["counters", "COUNTER_KEYS"]
