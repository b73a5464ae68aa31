"""The neuron backend: an NxD-style decoder over static-shape graphs.

A context-encoding graph per prefill bucket and a token-generation (or speculation)
graph per batch x sequence bucket, each compiled once and cached on disk by config,
bucket, dtype and compiler (not by weights: the graphs take the weights as inputs).
The KV cache lives in the decode state, addressed by seq_id (slot); sampling runs
inside the token-generation graph. One compile seam: ``torch_neuronx.trace`` on a
machine with Neuron devices, torch.export + Inductor on the CPU otherwise, compiling
the very same graphs. ``docs/neuron.md`` says what runs where and what was verified.

Imports nothing; ``plugin.py`` registers the backend without importing torch.
"""
