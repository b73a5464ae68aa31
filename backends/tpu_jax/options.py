"""The tpu_jax engine's options, and the sharding rules they may override.

Imports no JAX: the single-host engine checks its options with this table, and the Ray
leader (``ray_engine.py``) checks the same table before it starts a worker, then forwards
the options to every worker's engine. ``polyengine.options.check_options`` does the
checking; the rules' vocabulary (mesh axes, logical axes, defaults) is here because the
``sharding_rules`` option is written in it (:mod:`.sharding` uses it for the mesh).
"""

from __future__ import annotations

from typing import Any

from polyengine.engine import Option
from polyengine.errors import InvalidRequest, UnsupportedFeature
from polyengine.pages import pages_for
from polyengine.models.blocks import BLOCK_FORMATS, FLOAT_FORMATS
from polyengine.models.quantize import WEIGHT_MODES

__all__ = ["OPTIONS", "WEIGHT_FORMATS", "BATCHED_PREFILL_PLATFORMS", "MESH_AXES", "LOGICAL_AXES", "DEFAULT_RULES", "rules_problem", "check_pages"]

# The weight formats the engine computes on as stored (Capabilities.weight_formats, and
# `polyengine backends --verbose` without starting JAX): the float ones, and every GGUF
# block format: Q4_0/Q4_1/Q4_K as two 4-bit values a byte, Q8_0/Q5_0/Q5_1/Q5_K/Q6_K as
# int8 values, with their scales (and offsets) per group on the mesh
# (quantize.block_arrays). Any other format is converted to float32 one tensor at a time
# as it loads, then to the compute dtype.
WEIGHT_FORMATS = (*FLOAT_FORMATS, *BLOCK_FORMATS)

# Option batched_prefill "auto": the platforms where one program per batch is declared
# (docs/tpu_jax.md, "Batched prefill": on the CPU its programs cost more warm-up than they save).
BATCHED_PREFILL_PLATFORMS = ("tpu", "gpu")

MESH_AXES = ("dp", "tp")
# Every logical axis an array of this backend is described with.
LOGICAL_AXES = ("layers", "slots", "heads", "kv_heads", "mlp", "embed", "vocab", "positions", "head_dim")
DEFAULT_RULES: dict[str, str | None] = {
    "layers": None, "slots": "dp", "heads": "tp", "kv_heads": "tp", "mlp": "tp",
    "embed": None, "vocab": None, "positions": None, "head_dim": None,
}


def rules_problem(overrides: dict[str, Any]) -> str | None:
    """What is wrong with a ``sharding_rules`` value (logical axis -> mesh axis or None)."""
    for logical, axis in overrides.items():
        if logical not in LOGICAL_AXES:
            return f"names logical axis {logical!r}; the logical axes are {', '.join(LOGICAL_AXES)}"
        if axis is not None and axis not in MESH_AXES:
            return f"maps {logical!r} to {axis!r}; use a mesh axis ({', '.join(MESH_AXES)}) or None"
    return None


OPTIONS: dict[str, Option] = {
    "platform": Option("", "'' is JAX's default backend (TPU, else GPU, else CPU); or 'cpu', 'tpu', 'gpu'"),
    "tensor_parallel": Option(0, "devices per tensor-parallel group (heads, MLP); 0 chooses", minimum=0),
    "data_parallel": Option(0, "device groups over the slots; 0 chooses", minimum=0),
    "sharding_rules": Option({}, "logical axis -> 'tp' | 'dp' | None, over the default rules", check=rules_problem),
    "quantize": Option("", "weights: 'int8' (per channel) or 'int8-block32'", choices=("", *WEIGHT_MODES)),
    "kv_quantize": Option("", "'int8': int8 KV cache, a scale per slot, position and KV head", choices=("", "int8")),
    # K/V in a pool of pages shared by reference count (polyengine.pages, docs/design.md "Pages";
    # paged.py): inserting a prefix shares its pages instead of copying its K/V into the slot's row
    "page_size": Option(0, "K/V pages of this many positions (0: one contiguous cache row per slot)",
                        minimum=0, maximum=4096),
    "kv_pages": Option(0, "with page_size: the pages the K/V of slots and prefixes share (0: as many as they "
                          "use); the driver admits requests by free pages", minimum=0),
    # decode attention over the pages: gathered per layer, or read in place by JAX's Pallas
    # TPU kernel (pallas.py; docs/tpu_jax.md, "Pages")
    "paged_attention": Option("auto", "with page_size, decode attention: 'gather' (each row's pages gathered per "
                                      "layer), 'pallas' (JAX's Pallas paged-attention kernel reads them in place, "
                                      "K/V in bfloat16; off TPU under Pallas's interpreter, for tests: slow), or "
                                      "'auto' (pallas on TPU with 16-bit K/V, else gather)",
                              choices=("auto", "gather", "pallas")),
    "attention": Option("sdpa", "the shared model's attention path", choices=("sdpa", "eager")),
    "candidates": Option(64, "top-k bound under which top-k/top-p skip the full vocabulary sort", minimum=1),
    "compile_cache": Option("", "keep compiled programs on disk for later processes: 'auto' (a private folder under "
                                "polyengine's cache) or an absolute path; '' leaves JAX's own setting"),
    "batched_prefill": Option("auto", "prefill_batch's entries in one program per output bucket (capability "
                                      "batched_prefill): 'on', 'off', or 'auto' (on for TPU and GPU, off on the CPU)",
                              choices=("auto", "on", "off")),
    # a long prompt prefills on a thread of its own beside the decode steps (capability
    # prefill_lane; docs/tpu_jax.md, "The prefill lane")
    "prefill_lane": Option("auto", "prefill long prompts beside the decode steps (capability prefill_lane): 'on', "
                                   "'off', or 'auto' (on the CPU platform; off on TPU and GPU, "
                                   "where a device runs one program at a time)", choices=("auto", "on", "off")),
    "warmup": Option(False, "compile every bucket when the weights load (else on first use)"),
    "profiler_port": Option(0, "start JAX's profiler server on this port", minimum=0, maximum=65535),
    "trace_dir": Option("", "write a JAX trace of the first trace_steps generate steps here"),
    "trace_steps": Option(16, "generate steps the trace covers", minimum=1),
}


def check_pages(options: dict[str, Any], max_cache_length: int, backend: str) -> None:
    """The paged K/V options (page_size, kv_pages) against each other, the context and
    kv_quantize: the single-host engine's checks, made by the Ray leader too before any
    worker starts."""
    ps, kv_pages = options["page_size"], options["kv_pages"]
    if kv_pages and (not ps or kv_pages < pages_for(max_cache_length, ps) + 1):
        raise InvalidRequest(
            f"kv_pages={kv_pages} needs page_size and at least one context's pages and one more "
            f"({pages_for(max_cache_length, ps or 1) + 1} with page_size={ps or 1}); raise it or leave it 0",
            field="options.kv_pages")
    if ps and options["kv_quantize"] == "int8":
        raise UnsupportedFeature("kv_quantize='int8' with page_size", backend,
                                 "int8 K/V are kept in the contiguous cache only; use one or the other",
                                 field="options.kv_quantize")
