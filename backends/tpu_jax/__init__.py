"""The tpu_jax backend: JAX inference on TPUs (and on the CPU, or GPU JAX, elsewhere).

The model is the shared PyTorch forward (``polyengine.backends.torch_common``) run
through torchax inside jitted JAX programs, as JetStream-PyTorch runs its torch models
on JAX; the sampler is a JAX port of the core's semantics with JAX's own Threefry.
Weights and KV cache are sharded over a ``jax.sharding.Mesh`` by one rules object;
``ray_engine`` spreads one JAX program over Ray workers (multi-host) and ``disagg``
separates prefill and decode workers. Registers ``tpu_jax`` and ``tpu_jax_ray``.
"""
