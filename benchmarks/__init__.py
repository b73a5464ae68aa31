"""``polyengine bench``: the standard throughput workload, run on polyengine and its peers.

This package measures; it never changes how anything runs. It drives polyengine
backends only through ``polyengine.LLM`` and the engine protocol, so any registered
backend can be measured, and it runs each system (a polyengine backend and setting,
transformers, llama.cpp) in its own subprocess, so each one's peak RSS is its own and a
crashing peer cannot take the run down.

The core never imports this package, and no module here imports torch, transformers
or llama_cpp at module level: the peers' runners import them inside the worker
subprocess that needs them.

Modules: ``workload`` (what is measured), ``stats`` (medians, rates, RSS), ``host``
(CPU model and ISA flags), ``phases`` (warm-up, repeats and medians for any system),
``run_polyengine`` / ``run_transformers`` / ``run_llamacpp`` (one system each),
``gguf_convert`` (F16/F32 copies of a GGUF for llama.cpp), ``worker`` (the subprocess
entry point), ``jobs`` (spawning workers, their events), ``progress``, ``report``
(the table, the targets and the JSON), ``cli`` (the ``bench`` command).
"""

__all__: list[str] = []
