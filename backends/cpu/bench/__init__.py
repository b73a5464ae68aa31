"""The cpu backend's own measurements of its kernels (each a ``python -m`` entry that
prints a table). They live in the backend because they time its internals (the block
kernels, ``TiledBlockLinear``), which the bench and its scripts may not import
(tests/test_cli_and_layers.py's layer rule):

- ``python -m polyengine.backends.cpu.bench.block_kernel_rates``: the block kernels in
  cache on one core, per format, rows of x and activations (``--against REV``: a git
  revision's kernels beside this tree's, a same-run A/B);
- ``python -m polyengine.backends.cpu.bench.block_rows_crossover FILE.gguf``: one
  projection at M rows on the block kernels and on the dequantized GEMM;
- ``python -m polyengine.backends.cpu.bench.long_prefill [MODEL]``: a long prompt as one
  forward and as pieces under ``prefill_forward_tokens``, time and peak memory.
"""
