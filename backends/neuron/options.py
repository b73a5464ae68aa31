"""The neuron backend's options (imports no torch: read by ``polyengine backends
--verbose`` and by the CLI's early ``--option`` checks without starting torch or a
compiler). The engine (:mod:`polyengine.backends.neuron.engine`) uses this table."""

from __future__ import annotations

import os

from polyengine.engine import Option

__all__ = ["COMPILERS", "CPU_DEFAULT", "OPTIONS"]

# The graph compilers: on the CPU compile path the exported program as it is ("export",
# the default there) or compiled to C++ by Inductor; neuronx on Neuron devices.
COMPILERS = ("export", "inductor", "neuronx")
# What compiler="auto" picks off Neuron devices: the suite's compile time against the
# decode speed, measured (docs/neuron.md, "Choosing the CPU compiler").
CPU_DEFAULT = "export"


def _absolute(path: str) -> str | None:
    """A cache folder is absolute: a relative one would follow the working directory."""
    return None if not path or os.path.isabs(os.path.expanduser(path)) else "must be an absolute path (or '')"


OPTIONS = {
    "compiler": Option("auto", "'export' (CPU: the exported graphs run as they are, compiled in seconds), "
                               "'inductor' (CPU: compiled to C++, minutes per graph, faster steps), 'neuronx' "
                               "(Neuron devices), 'auto': neuronx where usable, else export",
                       choices=("auto",) + COMPILERS),
    "cache_dir": Option("", "compiled graphs (inductor, neuronx; export keeps none); '' = $POLYENGINE_NEURON_CACHE "
                            "or ~/.cache/polyengine/neuron", check=_absolute),
    "batch_buckets": Option((), "seq_ids per token-generation step; () = (max_slots,)"),
    "seq_buckets": Option((), "attended cache positions per step; () = see buckets.py"),
    # 1 = plain decoding, the default: measured faster with the built-in draft (docs/neuron.md)
    "speculation": Option(1, "tokens per step: 1 = plain decoding, k in 2..8 = k - 1 drafts of the truncated "
                             "target verified per step", minimum=1, maximum=8),
    "draft_layers": Option(0, "the draft = the target's first draft_layers layers; 0 = half of them", minimum=0),
    "async_steps": Option(True, "run steps on a worker thread; the caller reads step n while n+1 runs"),
    "threads": Option(0, "CPU intra-op threads (0: torch's default)", minimum=0),
    # The block KV layout, NxD's (docs/neuron.md, "Pages"): pools of blocks shared by reference
    # count (polyengine.pages), a block table per slot; inserting a prefix shares its blocks
    "page_size": Option(0, "K/V in blocks (pages) of this many positions (0: one contiguous cache row per slot); "
                           "on Neuron devices the pools are the NxD program's state", minimum=0, maximum=4096),
    "kv_pages": Option(0, "with page_size: the blocks the K/V of slots and prefixes share (0: as many as they use, "
                          "the pool's graphs compiled again for each size it grows to; on Neuron devices max_slots "
                          "contexts' blocks, one size); the driver admits requests by free blocks", minimum=0),
    # Several prompts of one bucket in one context-encoding graph (docs/neuron.md, "Batched prefill")
    "batched_prefill": Option("auto", "prefill_batch's fresh prompts in one context-encoding graph per bucket, 2 or "
                                      "4 at a time (capability batched_prefill): 'on', 'off', or 'auto' (on for the "
                                      "CPU compile path; off on Neuron devices, where 'on' adds the batched models to "
                                      "the NxD program, by construction: not run on a device)",
                              choices=("auto", "on", "off")),
    # Prompts continuing a prefix (docs/neuron.md, "Prefix reuse"): the continuation graphs
    "prefix_reuse": Option("auto", "continuation graphs, one per (prefix bucket, prompt bucket) pair, so a prompt "
                                   "continues a prefix (capabilities prefix_reuse, prefix_truncate: the prefix cache, "
                                   "chunked prefill): 'on', 'off' (fewer graphs to compile; whole prompts only), or "
                                   "'auto' (on for the CPU compile path; off on Neuron devices, where 'on' adds the "
                                   "continuation models to the NxD program, by construction: not run on a device)",
                           choices=("auto", "on", "off")),
    "tp_degree": Option(1, "NeuronCores the model is split over (tensor parallel, as NxD splits it); neuronx only",
                        minimum=1),
}
