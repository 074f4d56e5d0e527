"""Engine-harness stub of vllm._C_stable_libtorch (vLLM's compiled CUDA ops;
the real module is a 90 MB shared library, not carried). Importing the real
one registers the ``torch.ops._C*`` operators; this one registers none, so
any call of such an operator fails with torch's own error, and vLLM's own
custom allreduce reports itself unavailable (its ``ops.meta_size()`` probe
raises). Copied into the trimmed vLLM wheel by prepare.py."""

__tp_allreduce_stub__ = True
