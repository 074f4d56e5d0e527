"""Engine adapters: ``sglang`` (patches SGLang's custom-allreduce dispatch)
and ``vllm`` (a platform plugin). Importing this package imports neither
engine nor PyTorch."""
