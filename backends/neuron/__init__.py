"""The neuron backend: an NxD-style decoder over static-shape graphs.

A context-encoding graph per prefill bucket and a token-generation (or speculation)
graph per batch x sequence bucket, each compiled once and cached on disk by config,
bucket, dtype and compiler (never by weights). Sampling runs inside the
token-generation graph; the KV cache is addressed by seq_id (slot). Two places for the
very same graphs: on a machine with Neuron devices, one neuronx-distributed model of
every graph whose weights and KV cache live on the NeuronCores (``nxd.py``); elsewhere
torch.export + Inductor on the CPU, with the weights and the cache as graph inputs.
``docs/neuron.md`` says what runs where and what was verified.

Imports nothing; ``plugin.py`` registers the backend without importing torch.
"""
