"""llama.cpp as a peer, through llama-cpp-python's low-level batch API.

The high-level ``Llama`` class runs one sequence; batched decoding needs the batch API
(``llama_batch`` with one sequence id per row, ``llama_decode``, ``llama_get_logits_ith``),
which is what llama.cpp's own server uses. So this module drives it directly:

- a context per phase shape: ``n_seq_max`` = the batch, each sequence with its own KV
  cells (not unified: a row attends only over its own cache), ``n_ctx`` = batch x the
  per-sequence length rounded up to 256 (llama.cpp pads context sizes to 256);
- prompts go in as one batch (split at ``n_batch``) with logits only at each prompt's
  last token; then each decode step is one ``llama_decode`` of one token per sequence;
- greedy: the argmax of each row's logits, taken in NumPy (EOS is never special here:
  every row runs to its length, as ``ignore_eos`` does in polyengine);
- serve: continuous batching as llama.cpp's server does it: a free sequence id takes
  the next request, whose prompt joins the same ``llama_decode`` as the running rows'
  next tokens; a finished request's cells are removed (``llama_memory_seq_rm``).

Threads: llama.cpp takes two counts, ``n_threads`` for single-token batches and
``n_threads_batch`` for everything bigger. Each is chosen once at load from the
candidates (default 1 and 2) by the best of three short timed runs (a batch-1 decode,
a 128-token prompt), and the chosen pair is reported. Everything else is llama.cpp's
default (KV cache F16, flash attention "auto", ``n_ubatch`` 512).

This module imports llama_cpp: only a worker subprocess imports it.
"""

from __future__ import annotations

import importlib.metadata
import sys
import time
from typing import Any

import numpy as np

from polyengine.benchmarks.phases import DecodeRun, ServeRun
from polyengine.benchmarks.workload import Request, prompts

__all__ = ["LlamaCppSystem", "quiet_log", "cpu_features"]

_PAD = 256
_N_BATCH = 2048


_GGML_LOG_WARN = 3  # ggml_log_level: 0 none, 1 debug, 2 info, 3 warn, 4 error, 5 continuation


def quiet_log(level: int, text: bytes, user_data: object) -> None:
    """A llama.cpp log callback that passes on its warnings and errors only."""
    if level in (_GGML_LOG_WARN, _GGML_LOG_WARN + 1):
        sys.stderr.write(text.decode("utf-8", errors="replace"))


def cpu_features(info: str) -> set[str]:
    """The CPU features llama.cpp's system info reports as on ("AVX2 = 1" -> "AVX2")."""
    out = set()
    for part in info.split("|"):
        name, _, value = part.rpartition("=")
        name = name.split(":")[-1].strip()
        if name and value.strip() == "1":
            out.add(name)
    return out


def _library(lc: Any) -> str:
    """The folder llama-cpp-python loaded libllama from (LLAMA_CPP_LIB_PATH, else its own)."""
    import os
    from pathlib import Path

    return os.environ.get("LLAMA_CPP_LIB_PATH") or str(Path(lc.__file__).parent / "lib")


class LlamaCppSystem:
    def __init__(self, *, model: str, quant: str, threads: list[int] | int = (1, 2),
                 chosen: tuple[int, int] | None = None, forbid: list[str] | tuple[str, ...] = ()):
        import llama_cpp as lc

        self.lc = lc
        # llama.cpp logs every context it makes; keep only warnings and errors, so a
        # failed worker's output tail shows what went wrong.
        self._log = lc.llama_log_callback(quiet_log)
        lc.llama_log_set(self._log, None)
        lc.llama_backend_init()
        # ``forbid``: features an emulated host lacks (``--emulate``): a library built with
        # them would measure this CPU, not that host kind
        info = lc.llama_print_system_info().decode("utf-8", errors="replace")
        found = sorted(cpu_features(info) & set(forbid))
        if found:
            raise RuntimeError(f"the llama.cpp library loaded ({_library(lc)}) uses {', '.join(found)}, which the "
                               f"emulated host lacks; build one without them and pass its folder as --llamacpp-lib "
                               f"(docs/benchmarks.md)")
        params = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(model.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model}")
        self.vocab_size = int(lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model)))
        self.ctx = None
        self.first_build_seconds: float | None = None  # the first context's creation (the load_s metric)
        self._shape: tuple[int, int] | None = None
        self._batch = lc.llama_batch_init(_N_BATCH, 0, 1)
        candidates = sorted({int(t) for t in ([threads] if isinstance(threads, int) else threads)})
        # ``chosen``: the pair an earlier worker picked for this file (the long batch
        # reuses the standard part's choice rather than timing it again).
        self.threads, self.threads_batch = tuple(chosen) if chosen else self._choose_threads(candidates)
        self.description = {
            "quant": quant,
            "threads": self.threads,
            "threads_batch": self.threads_batch,
            "thread_candidates": candidates,
            "llama_cpp_python": importlib.metadata.version("llama_cpp_python"),
            "file": model,
            "library": _library(lc),
            "cpu_features": sorted(cpu_features(info)),
        }

    # -- contexts and batches -------------------------------------------------------------

    def _context(self, n_seq: int, per_seq: int) -> Any:
        """A context for ``n_seq`` sequences of up to ``per_seq`` tokens, emptied."""
        lc = self.lc
        per_seq = -(-per_seq // _PAD) * _PAD
        if self._shape != (n_seq, per_seq):
            if self.ctx is not None:
                lc.llama_free(self.ctx)
                self.ctx = None
            p = lc.llama_context_default_params()
            p.n_ctx = n_seq * per_seq
            p.n_batch = _N_BATCH
            p.n_seq_max = n_seq
            p.kv_unified = False
            p.no_perf = True
            p.n_threads = p.n_threads_batch = getattr(self, "threads", 1) or 1
            if hasattr(self, "threads_batch"):
                p.n_threads_batch = self.threads_batch
            start = time.perf_counter()
            self.ctx = lc.llama_init_from_model(self.model, p)
            if self.first_build_seconds is None:
                self.first_build_seconds = time.perf_counter() - start
            if not self.ctx:
                raise RuntimeError(f"llama.cpp could not make a context for {n_seq} x {per_seq} tokens")
            self._shape = (n_seq, per_seq)
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        return self.ctx

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """Run (token, position, sequence, wants_logits) entries; greedy token per wanting entry's sequence."""
        lc, b, out = self.lc, self._batch, {}
        for at in range(0, len(entries), _N_BATCH):
            chunk = entries[at: at + _N_BATCH]
            b.n_tokens = len(chunk)
            for i, (tok, pos, seq, want) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
                b.seq_id[i][0] = seq
            rc = lc.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} for {len(chunk)} tokens")
            for i, (_, _, seq, want) in enumerate(chunk):
                if want:
                    logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i), shape=(self.vocab_size,))
                    out[seq] = int(logits.argmax())
        return out

    # -- threads --------------------------------------------------------------------------

    def _choose_threads(self, candidates: list[int]) -> tuple[int, int]:
        """Best n_threads (batch-1 decode) and n_threads_batch (a prompt), best of 3 short tries each."""
        self.threads = self.threads_batch = candidates[-1]
        if len(candidates) == 1:
            return candidates[0], candidates[0]
        prompt = prompts(self.vocab_size, 1, 128, phase="warmup")[0]
        single, batch = {}, {}
        self._context(1, len(prompt) + 16)
        for t in candidates:
            self.lc.llama_set_n_threads(self.ctx, t, t)
            single[t] = min(self.decode([prompt[:16]], 12).decode_seconds for _ in range(3))
            batch[t] = min(self.prefill(prompt) for _ in range(3))
        return min(single, key=single.get), min(batch, key=batch.get)

    # -- the phases -----------------------------------------------------------------------

    def decode(self, prompts_: list[list[int]], new_tokens: int, room: int | None = None) -> DecodeRun:
        b, plen = len(prompts_), len(prompts_[0])
        self._context(b, plen + (new_tokens if room is None else room))
        entries = [(tok, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts_) for pos, tok in enumerate(p)]
        nxt = self._decode(entries)
        stamps = [time.perf_counter()]
        for step in range(1, new_tokens):
            nxt = self._decode([(nxt[s], plen + step - 1, s, True) for s in range(b)])
            stamps.append(time.perf_counter())
        return DecodeRun(
            decode_tokens=b * (new_tokens - 1),
            decode_seconds=stamps[-1] - stamps[0],
            step_seconds=[y - x for x, y in zip(stamps, stamps[1:])],
            step_tokens=[b] * (len(stamps) - 1),
        )

    def prefill(self, prompt: list[int]) -> float:
        self._context(1, len(prompt) + 2)
        start = time.perf_counter()
        self._decode([(tok, pos, 0, pos == len(prompt) - 1) for pos, tok in enumerate(prompt)])
        return time.perf_counter() - start

    def serve(self, requests: list[Request], slots: int, sized_for: list[Request] | None = None) -> ServeRun:
        self._context(slots, max(len(r.prompt) + r.max_tokens for r in (sized_for or requests)))
        mem = self.lc.llama_get_memory(self.ctx)
        queue = list(range(len(requests)))
        free = list(range(slots))
        running: dict[int, list[int]] = {}  # seq -> [request index, tokens made, next token, next position]
        ttfts: list[float] = []
        produced = 0
        t0 = time.perf_counter()
        while queue or running:
            entries = [(st[2], st[3], seq, True) for seq, st in running.items()]
            admitted = []
            while queue and free:
                seq, idx = free.pop(0), queue.pop(0)
                p = requests[idx].prompt
                entries += [(tok, pos, seq, pos == len(p) - 1) for pos, tok in enumerate(p)]
                admitted.append((seq, idx))
            nxt = self._decode(entries)
            now = time.perf_counter()
            for seq, st in running.items():
                st[1] += 1
                st[2], st[3] = nxt[seq], st[3] + 1
            for seq, idx in admitted:
                running[seq] = [idx, 1, nxt[seq], len(requests[idx].prompt)]
                ttfts.append(now - t0)
            for seq in [s for s, st in running.items() if st[1] >= requests[st[0]].max_tokens]:
                produced += running.pop(seq)[1]
                self.lc.llama_memory_seq_rm(mem, seq, -1, -1)
                free.append(seq)
        return ServeRun(completion_tokens=produced, seconds=time.perf_counter() - t0, ttfts=ttfts)
