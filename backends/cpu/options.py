"""The cpu backend's options (imports no torch: read by ``polyengine backends
--verbose`` and by other backends' refusals without starting torch). What each choice
becomes is decided in one place, :class:`polyengine.backends.cpu.plan.CpuPlan`."""

from __future__ import annotations

from dataclasses import replace

from polyengine.engine import Option
from polyengine.hostinfo import ISA_PATHS
from polyengine.models.blocks import BLOCK_FORMATS
from polyengine.models.quantize import WEIGHT_MODES

from polyengine.backends.torch_common.options import SHARED_OPTIONS

__all__ = ["OPTIONS", "WEIGHT_FORMATS"]

OPTIONS = {
    **SHARED_OPTIONS,
    # K/V in pages of 16 positions by default (docs/cpu.md, "Paged K/V"): a prefix inserted
    # or continued shares its pages, the prefill lane runs beside the steps on them
    "page_size": replace(SHARED_OPTIONS["page_size"], default=16),
    "threads": Option(0, "intra-op threads (0: torch's default)", minimum=0),
    "async_steps": Option(True, "run each step on a worker thread (results read later)"),
    # a long prompt prefills on threads of its own while the streams decode on the rest
    # (capability prefill_lane; docs/cpu.md, "The prefill lane")
    "prefill_threads": Option(-1, "threads of the prefill lane beside the decode steps (-1: half the engine's "
                                  "where it has two or more; 0: no lane)", minimum=-1),
    "cpu_kernels": Option(True, "decode products through the host-compiled kernels (csrc/)"),
    # "auto": the best this CPU runs (-march=native); a lower one forced tests and measures
    # that path on a bigger host; one this CPU cannot execute is refused
    "isa": Option("auto", "ISA path of the host-compiled kernels", choices=("auto", *ISA_PATHS)),
    # each thread takes its share of a fused step's product in chunks, then chunks from the
    # back of the other threads' shares: a thread held back (another process on its core)
    # hands the rest of its share on (docs/cpu.md, "Products shared by chunks")
    "dynamic_split": Option(True, "the fused step's products shared between the threads by chunks, a thread done "
                                  "with its share taking chunks of the others' (False: fixed shares)"),
    # in a short fused step a thread waiting at a barrier yields its core first, so a thread
    # the OS woke meanwhile (the driver, a server's event loop, its client) runs within a
    # phase instead of at the scheduler's next tick (docs/cpu.md, "Barriers that yield")
    "barrier_yield": Option(4, "in fused steps of at most this many rows a thread waiting at a phase barrier "
                               "yields its core before it spins (0: never, spin and yield only after a long wait)",
                            minimum=0),
    "fused_decode": Option(True, "the whole decode step in one host-compiled call (needs cpu_kernels; Llama "
                                 "family only, other architectures use the torch forward)"),
    # the KV cache as an anonymous memory map, pages made as slots write them and handed
    # back when a slot is freed (torch_common/hostmem.py); "reserve" holds every slot's
    # full context from the start
    "kv_memory": Option("grow", "KV cache pages held as used ('grow') or all from the start ('reserve')",
                        choices=("grow", "reserve")),
    # a prefill of up to 16 tokens (a chunked prompt's piece, a prefix hit's tail, a short
    # prompt) as one fused call: the decode step's kernel over the prefill's own K/V buffer
    "fused_prefill": Option(True, "prefills of up to 16 tokens (64 on int16 tiles, short prefixes) through the fused "
                                   "decode step (with fused_decode)"),
    # with page_size and fused_prefill: generate_with_prefill (capability mixed_step) runs a
    # new request's prompt rows inside the decode step's own fused pass, one pass over the
    # weights for both (docs/cpu.md, "The mixed step")
    "mixed_step": Option(True, "a new request's prompt rows inside the decode step's fused pass (with page_size "
                               "and fused_prefill)"),
    "live_rows": Option(True, "decode only the live slots' rows (False: every slot, as on a device)"),
    # "int8": weight-only int8 with per-output-channel scales; "int8-block32": a scale per
    # 32 weights of a row (closer to float32); float32 accumulation either way
    "quantize": Option("", "int8 weights: 'int8' (per channel) or 'int8-block32'", choices=("", *WEIGHT_MODES)),
    # with int8 weights: "int8" quantizes each decode product's activations to int8 per 32
    # values (integer dot products, as llama.cpp's Q8_0); "int8x2" adds a second int8 row
    # carrying the first's rounding error; "float" keeps them float32; "auto" is "int8x2"
    # where every input size is a multiple of 32, else "float" (docs/cpu.md)
    "int8_compute": Option("auto", "activations of int8 products", choices=("auto", "int8x2", "int8", "float")),
    # float32 compute: the projections and the LM head stored as bfloat16 (rounded once at
    # load), widened exactly in the products: half the bytes a decode step streams
    "weight_dtype": Option("auto", "float32 compute: projection weights stored as 'bfloat16' ('auto': the "
                                   "compute dtype)", choices=("auto", "bfloat16")),
    "bf16_compute": Option("float", "with weight_dtype bfloat16: decode products' activations, 'float' or "
                                    "'bf16' (vdpbf16ps where the CPU has AVX512-BF16)", choices=("float", "bf16")),
    "prefill_compute": Option("auto", "prefill products on int8/bfloat16/block weights: 'float', 'bf16', "
                                      "'int16' (block weights on int16 tiles, AVX-512 VNNI), or 'auto' (bf16 with "
                                      "bf16_compute=bf16 or int8_compute=int8 on a CPU with bfloat16 units; "
                                      "else int16 tiles where they run)", choices=("auto", "float", "bf16", "int16")),
    # a copy of the block weights with sixteen rows interleaved, made tensor by tensor at
    # load (csrc/packed.h): a block's conversion and scale serve sixteen outputs; decode's
    # products and prefill's tiles read it, and the file's pages of those matrices are released
    "repack_weights": Option("auto", "products on a copy of the GGUF blocks with sixteen rows interleaved, made "
                                     "at load (AVX-512 VNNI or AVX2, int8 activations); 'auto': wherever that runs, "
                                     "Q8_0 left as mapped under int8x2 activations",
                             choices=("auto", True, False)),
    # the repacked copy in one map of 2 MiB transparent huge pages (MADV_HUGEPAGE): a decode
    # step streams the whole model, and 4 KiB pages cost a page walk each 4 KiB
    "huge_pages": Option(False, "with repack_weights: the repacked weights in one map advised MADV_HUGEPAGE "
                                "(2 MiB transparent huge pages); 'auto': where the host's THP mode is madvise or "
                                "always; off by default (docs/cpu.md, \"Weights in huge pages\")",
                         choices=("auto", True, False)),
    "prefill_attention": Option("auto", "a prefill's causal attention: 'kernel' (host-compiled), 'sdpa' "
                                        "(torch), or 'auto' (kernel on AVX-512 kernels)",
                                choices=("auto", "kernel", "sdpa")),
    # the sampler's random stream (Threefry-2x32-20 per row and token) in one host-compiled
    # pass instead of ~140 torch ops over (rows, vocab), the same bits; and plain temperature
    # sampling's whole draw there, in float64; greedy rows' argmax and the finiteness check
    # in one pass (docs/cpu.md, "What it does": Sampling)
    "sampler_kernel": Option(True, "the sampled rows' random stream and draw, greedy rows' argmax and the "
                                   "finiteness check through the host-compiled kernels (needs cpu_kernels; "
                                   "False: torch ops)"),
    "fuse_projections": Option(True, "bfloat16 weights: q/k/v and gate/up as one matrix each for the torch "
                                     "forward's GEMMs (prefill)"),
}

# The weight formats the engine computes on as stored (Capabilities.weight_formats, and
# `polyengine backends --verbose` without starting torch): float32, and every GGUF block
# format of csrc/gguf.h read where the file maps it (blocks.py). Any other format (F16,
# BF16, the ggml types outside these) is converted to float32 one tensor at a time.
WEIGHT_FORMATS = ("F32", *BLOCK_FORMATS)
