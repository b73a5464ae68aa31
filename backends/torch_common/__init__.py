"""Code the torch backends share: the functional model and the batched device sampler.

Registers no backend (no plugin, no entry point); ``cpu``, ``cuda_torch``, ``tpu_jax``
and ``neuron`` import it. Its modules import torch at module level, so nothing in the
core (and nothing imported at backend discovery) may import them, except the two that
import no torch: :mod:`.options` (the options every torch engine has) and :mod:`.spec`
(a torch backend's BackendSpec, for its plugin).

- :mod:`.engine`: ``TorchEngine``, the protocol's flow for every torch engine.
- :mod:`.model`: ``TorchWeights``, ``forward``, ``StepModule`` (one forward for every
  architecture the loader accepts; static-shape friendly, exportable).
- :mod:`.sampling`: ``TorchSampler`` and the pure ``sample``/``record``/``override``
  functions it wraps (the core's sampler semantics, batched over slots).
- :mod:`.threefry`: the core's Threefry-2x32 random stream in torch, bit-exact.
- :mod:`.state`: ``SlotsInFlight``, the slots and step-in-flight methods of a decode state.
"""
