"""The options every torch engine has (imports no torch: a backend's option table is
read without starting its framework, e.g. by ``polyengine backends --verbose``)."""

from __future__ import annotations

from polyengine.engine import Option

__all__ = ["ATTENTION_IMPLS", "SHARED_OPTIONS"]

ATTENTION_IMPLS = ("sdpa", "eager")

SHARED_OPTIONS = {
    "attention": Option("sdpa", "attention implementation", choices=ATTENTION_IMPLS),
    "kv_block": Option(64, "attention reads the cache up to the longest slot, rounded up to this", minimum=1),
    "sampler_dtype": Option("float32", "float64 for bit-for-bit greedy ties with the reference",
                            choices=("float32", "float64")),
    # K/V stored narrower than float32 compute (half the cache's memory and reads):
    # rounded to nearest even on write, widened on read (fused step and torch forward alike)
    "kv_dtype": Option("auto", "KV cache element type: 'auto' (the compute dtype), 'bfloat16' or 'float16'",
                       choices=("auto", "bfloat16", "float16")),
    # K/V in a pool of pages shared by reference count (polyengine.pages, docs/design.md "Pages"):
    # inserting a prefix shares its pages instead of copying its K/V into the slot's row
    "page_size": Option(0, "K/V pages of this many positions (0: one contiguous cache row per slot)",
                        minimum=0, maximum=4096),
    "kv_pages": Option(0, "with page_size: the pages the K/V of slots and prefixes share (0: as many as they "
                          "use); the driver admits requests by free pages", minimum=0),
}
