"""transformers as a peer: the same weights, ``generate`` with a static batch, eager PyTorch.

The model comes from the same GGUF (``from_pretrained(dir, gguf_file=...)``, which
needs ``accelerate`` and dequantizes to float32) or from an HF folder. Converting the
GGUF takes tens of seconds, so the float32 result is saved once as safetensors under
the cache folder, keyed by the file's path, size and modification time; later runs load
that copy in the dtype asked for (float32, or bfloat16 on CPUs with bf16 units).

- decode: one greedy ``generate`` over the batch (the prompts have equal lengths, so
  there is no padding); ``min_new_tokens`` holds EOS back so every row makes exactly
  ``new_tokens`` tokens, as polyengine's ``ignore_eos`` does. A stopping criterion that
  never stops stamps the time of every step: the first stamp is the first token.
- prefill: one forward pass over the prompt with ``logits_to_keep=1`` (what ``generate``
  does for its prefill) and the argmax of the last logits.
- serve: transformers has no scheduler in ``generate``, so the requests run as static
  batches of ``slots`` in arrival order, left-padded to the batch's longest prompt,
  each batch generating as many tokens as its longest request asks; only the tokens
  the requests asked for are counted, and a request's first token is its batch's.
- the prefix part (shared prefix, multi-turn): a request's TTFT is one forward pass
  to its first token; "with the cache" keeps the K/V (``past_key_values``) of the
  system prompt (prefilled by the first request, inside its time), which each request
  copies (``copy.deepcopy``, timed), or of the conversation's last prompt, which the
  next turn extends; either way the request runs only its new tokens. Answers are generated greedily outside the timed part.
  transformers has no scheduler, so the long-prompt-under-load workload is not run.

This module imports torch and transformers: only a worker subprocess imports it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import time
from pathlib import Path
from typing import Any

from polyengine.benchmarks.phases import DecodeRun, ServeRun
from polyengine.benchmarks.workload import Request

__all__ = ["TransformersSystem", "cached_folder", "hf_folder"]


def _gguf_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def cached_folder(model: str | Path, cache_dir: str | Path) -> tuple[Path, bool]:
    """Where the model's HF folder is, and whether it is there yet (no torch imported)."""
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path, True
    if not (path.is_file() and path.suffix.lower() == ".gguf"):
        raise ValueError(f"transformers needs a .gguf file or an HF folder, not {str(model)!r}")
    dest = Path(cache_dir) / f"hf-{path.stem}-{_gguf_key(path)}"
    return dest, (dest / "config.json").is_file() and any(dest.glob("*.safetensors"))


def hf_folder(model: str | None, cache_dir: str | Path) -> Path:
    """An HF folder holding the model: ``model`` itself, or the cached float32 copy of a GGUF."""
    from polyengine.models import default_model_path

    path = default_model_path() if model is None else Path(model).expanduser()
    dest, ready = cached_folder(path, cache_dir)
    if ready:
        return dest
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained while it still names its quantizer.
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    hf.save_pretrained(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)  # atomic: a run killed mid-save leaves no half copy behind
    return dest


class TransformersSystem:
    def __init__(self, *, model: str | None, dtype: str, cache_dir: str, threads: int | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        folder = hf_folder(model, cache_dir)
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype)).eval()
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, (list, tuple)) else cfg.eos_token_id
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else (eos if eos is not None else 0)
        self.description = {
            "dtype": dtype,
            "threads": torch.get_num_threads(),
            "attention": getattr(cfg, "_attn_implementation", None),
            "torch": torch.__version__,
            "transformers": importlib.metadata.version("transformers"),
            "weights": str(folder),
        }

    def _generate(self, prompts: list[list[int]], new_tokens: int) -> list[float]:
        """Greedy generate of a left-padded batch; returns the time of every step."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        torch, stamps = self.torch, []

        class Stamp(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=self.pad, stopping_criteria=StoppingCriteriaList([Stamp()]),
            )
        if out.shape[1] != width + new_tokens or len(stamps) != new_tokens:
            raise RuntimeError(f"generate made {out.shape[1] - width} tokens ({len(stamps)} steps), not {new_tokens}")
        return stamps

    def decode(self, prompts: list[list[int]], new_tokens: int, room: int | None = None) -> DecodeRun:
        """``room`` is ignored: generate's cache grows as it goes."""
        stamps = self._generate(prompts, new_tokens)
        b = len(prompts)
        return DecodeRun(
            decode_tokens=b * (new_tokens - 1),
            decode_seconds=stamps[-1] - stamps[0],
            step_seconds=[y - x for x, y in zip(stamps, stamps[1:])],
            step_tokens=[b] * (len(stamps) - 1),
        )

    def prefill(self, prompt: list[int]) -> float:
        torch = self.torch
        ids = torch.tensor([prompt], dtype=torch.long)
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
            int(out.logits[0, -1].argmax())
            return time.perf_counter() - start

    def serve(self, requests: list[Request], slots: int, sized_for: list[Request] | None = None) -> ServeRun:
        """``sized_for`` is ignored: generate sizes each static batch itself."""
        t0 = time.perf_counter()
        ttfts: list[float] = []
        for at in range(0, len(requests), slots):
            batch = requests[at: at + slots]
            stamps = self._generate([r.prompt for r in batch], max(r.max_tokens for r in batch))
            ttfts += [stamps[0] - t0] * len(batch)
        return ServeRun(completion_tokens=sum(r.max_tokens for r in requests),
                        seconds=time.perf_counter() - t0, ttfts=ttfts)


    # -- the prefix part (benchmarks/prefix_phases.py) ------------------------------------

    def _first(self, tokens: list[int], past: Any = None) -> Any:
        """One forward pass to the first token; returns the K/V cache it leaves."""
        torch = self.torch
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([tokens], dtype=torch.long), past_key_values=past, use_cache=True,
                             logits_to_keep=1)
            int(out.logits[0, -1].argmax())
        return out.past_key_values

    def shared(self, system: list[int], users: list[list[int]], new_tokens: int, cache: bool) -> list[float]:
        import copy

        base, out = None, []
        for user in users:
            start = time.perf_counter()
            if not cache:
                self._first(system + user)
            else:
                if base is None:
                    base = self._first(system)
                self._first(user, copy.deepcopy(base))
            out.append(time.perf_counter() - start)
        return out

    def turns(self, firsts: list[list[int]], users: list[list[list[int]]], answer: int, cache: bool) -> list[list[float]]:
        torch = self.torch
        out: list[list[float]] = [[] for _ in range(len(users) + 1)]
        for c, first in enumerate(firsts):
            prompt, past, seen = list(first), None, 0
            for turn in range(len(users) + 1):
                start = time.perf_counter()
                if cache and past is not None:  # the conversation's own cache: extended in place
                    past = self._first(prompt[seen:], past)
                else:
                    past = self._first(prompt)
                out[turn].append(time.perf_counter() - start)
                seen = len(prompt)
                if turn < len(users):
                    with torch.inference_mode():
                        ids = self.model.generate(
                            input_ids=torch.tensor([prompt], dtype=torch.long), max_new_tokens=answer,
                            min_new_tokens=answer, do_sample=False, pad_token_id=self.pad)
                    prompt = prompt + ids[0, len(prompt):].tolist() + users[turn][c]
        return out


if __name__ == "__main__":  # python -m ... MODEL CACHE_DIR: convert once, before any measured worker
    import sys

    print(hf_folder(sys.argv[1], sys.argv[2]))
