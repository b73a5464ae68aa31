"""Disaggregated prefill and decode for tpu_jax_ray: prompts prefill on workers of their own.

With the option ``prefill_workers=N`` the leader (:mod:`.ray_engine`) keeps its decode
workers (one JAX program over every host, as without the option) and adds N prefill
actors, each a single-host engine on its own devices. A prompt goes to one prefill
worker (round robin), which prefills it and exports the protocol's portable prefix
(float32 K/V after RoPE, the prompt, the raw logits, the sampling parameters, the
model fingerprint): its safetensors bytes stay in Ray's object store, never pickled,
and only the first token's packed row comes back to the leader. The prefix handle is
the bytes' ``ObjectRef``; ``insert`` passes it to every decode worker, Ray moves the
bytes to their nodes, and each imports (checking the fingerprint) and inserts. A prompt
that continues a prefix (``existing_prefix``) goes to a prefill worker with that
prefix's ref: the worker imports it, continues it, and exports the longer prefix. Since
the hand-off is the portable format, a prefix exported by any backend (the reference,
cpu) can be inserted here, and ours there.

The prefix lives as long as the leader's handle: the object store frees the bytes
when the last reference goes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from polyengine.prefix import PortablePrefix
from polyengine.sampling import SamplingParams

__all__ = ["PortableHandle", "PrefillPool"]


@dataclass(eq=False)
class PortableHandle:
    """``Prefix.kv`` of a disaggregated prefix: the portable bytes' ``ObjectRef``."""

    ref: Any

    def portable(self) -> PortablePrefix:
        """The portable prefix itself (fetched from the object store)."""
        import ray

        return PortablePrefix.from_bytes(ray.get(self.ref))


class PrefillPool:
    """The prefill workers of one leader engine: independent single-host engines built
    from the same model and config (their mesh chosen on their own devices)."""

    # A prefill worker has its own devices: the decode mesh's sizes do not apply.
    _MESH_OPTIONS = ("tensor_parallel", "data_parallel", "sharding_rules")

    def __init__(self, group, engine_id: str, model_ref: Any, config):
        self.group, self.engine_id = group, engine_id
        options = {k: v for k, v in config.options.items() if k not in self._MESH_OPTIONS}
        config = config.model_copy(update={"options": options})
        refs = [group.submit_one(i, "build", engine_id, model_ref, config) for i in range(len(group.workers))]
        group._gather(refs, "building the prefill engines")
        self._next = itertools.cycle(range(len(group.workers)))

    def _all(self, method: str, what: str) -> None:
        refs = [self.group.submit_one(i, method, self.engine_id) for i in range(len(self.group.workers))]
        self.group._gather(refs, what)

    def load(self) -> None:
        self._all("load", "loading the prefill workers' weights")

    def warmup(self) -> None:
        self._all("warmup", "warming up the prefill workers")

    def prefill(self, tokens: np.ndarray, sampling: SamplingParams,
                existing: PortableHandle | None = None, token_mask: np.ndarray | None = None
                ) -> tuple[np.ndarray, Any]:
        """Prefill on the next worker (the first token under ``token_mask``): (first
        token's packed row, portable bytes' ref). ``existing``: a prefix of this pool the
        tokens continue; its bytes go from the object store to the worker, which imports
        it first."""
        args = (self.engine_id, tokens, sampling, None if existing is None else existing.ref, token_mask)
        packed, data = self.group.submit_one(next(self._next), "prefill_portable", *args, num_returns=2)
        return self.group._gather([packed], "prefilling")[0], data

    def put(self, portable: PortablePrefix) -> PortableHandle:
        import ray

        return PortableHandle(ray.put(portable.to_bytes()))

    def first_token(self, handle: PortableHandle) -> int:
        ref = self.group.submit_one(next(self._next), "first_token", self.engine_id, handle.ref)
        return int(self.group._gather([ref], "sampling an imported prefix's first token")[0])
