"""The cpu backend: LLM inference on the host CPU with PyTorch and host-compiled
kernels (``csrc/``), built on the shared torch model and sampler
(``polyengine.backends.torch_common``). Its choices (ISA path, weight formats,
compute dtypes, KV memory, prefill paths) are resolved once into a
:class:`~polyengine.backends.cpu.plan.CpuPlan` that the engine runs."""
