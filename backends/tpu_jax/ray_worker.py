"""One host of a multi-host tpu_jax program: a Ray actor hosting the single-host engine.

The actor does not reimplement the engine (JetStream-PyTorch's ``ray_worker.py``
repeats its ``engine.py``; this one does not): it joins the JAX program
(``jax.distributed``; on the CPU with gloo collectives) and then holds
:class:`~polyengine.backends.tpu_jax.engine.TpuJaxEngine` instances, their decode
states and prefixes, by ids the leader (``ray_engine.py``) chose. Every process of the
program runs every call, in the same order (Ray runs one caller's calls to an actor in
submission order), so the collectives inside the jitted steps line up; only rank 0
sends results back, and only host data: packed result rows, logits, portable-prefix
bytes. Device arrays never leave their hosts.

Listeners bind to the Ray node's address: the JAX coordinator (on rank 0) and the
gloo transport. A Ray cluster kept on loopback therefore keeps JAX on loopback too.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["EngineWorker"]


class EngineWorker:
    """The actor class (``ray.remote`` is applied by the leader, so importing this
    module needs no Ray). JAX is imported only after :meth:`join` has set up the
    distributed runtime, since that must precede any use of a JAX backend."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.engines: dict[str, Any] = {}
        self.states: dict[str, Any] = {}
        self.prefixes: dict[str, Any] = {}

    # -- joining the program -------------------------------------------------------------

    @staticmethod
    def node_address() -> str:
        import ray

        return ray.util.get_node_ip_address()

    def coordinator_address(self) -> str:
        """A free port on this node for the JAX coordinator (rank 0 hosts it)."""
        host = self.node_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return f"{host}:{s.getsockname()[1]}"

    def join(self, coordinator: str) -> dict[str, Any]:
        """Join the JAX program; returns what this process sees (platform, devices)."""
        import jax

        from polyengine.backends.tpu_jax.xla_flags import prefer_memory_scheduler

        scheduler = prefer_memory_scheduler()  # before the first use of a backend (xla_flags.py)
        host = self.node_address()
        _gloo_on(host)
        if self.world > 1:
            jax.distributed.initialize(
                coordinator_address=coordinator, num_processes=self.world, process_id=self.rank,
                coordinator_bind_address=coordinator if self.rank == 0 else None)
        devices = jax.devices()
        import ray

        return {
            "rank": self.rank, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(), "address": host,
            "platform": devices[0].platform, "devices": len(devices), "local_devices": jax.local_device_count(),
            "process_count": jax.process_count(), "scheduler": scheduler, "xla_flags": os.environ.get("XLA_FLAGS", ""),
        }

    def capabilities(self) -> dict[str, Any]:
        """What an engine declares here: its dtypes depend on the platform."""
        import jax

        from polyengine.backends.tpu_jax.engine import _dtypes

        platform = jax.devices()[0].platform
        return {"dtypes": _dtypes(platform), "platform": platform}

    def host_memory(self) -> dict[str, Any]:
        """The host memory this worker could still allocate (bytes, None where unknown):
        what the leader checks this node's share against."""
        from polyengine.memory import available_host_memory

        return {"available": available_host_memory()}

    # -- engines -------------------------------------------------------------------------

    def build(self, engine_id: str, model, config) -> str:
        from polyengine.backends.tpu_jax.engine import TpuJaxEngine

        engine = TpuJaxEngine(model, config)
        self.engines[engine_id] = engine
        return engine.device

    def drop(self, kind: str, key: str) -> None:
        getattr(self, kind).pop(key, None)

    def load(self, engine_id: str) -> None:
        self.engines[engine_id].load_params()

    def warmup(self, engine_id: str) -> None:
        self.engines[engine_id].warmup()

    def init_state(self, engine_id: str, state_id: str) -> None:
        self.states[state_id] = self.engines[engine_id].init_decode_state()

    def _packed(self, engine, result) -> np.ndarray | None:
        """Rank 0's host copy of a result (one int32 buffer); other ranks send nothing."""
        if self.rank:
            return None
        r = result
        return engine.cfg.layout.pack(r.tokens, r.valid, r.lengths, r.logprobs, r.top_ids, r.top_logprobs)

    def prefill(self, engine_id: str, prefix_id: str, tokens: np.ndarray, sampling,
                existing_id: str | None = None, token_mask: np.ndarray | None = None) -> tuple[np.ndarray, int] | None:
        """Prefill (continuing the prefix held as ``existing_id``, if given; the first
        token under ``token_mask``); rank 0 returns the first token's packed row and the
        bytes the prefix holds."""
        engine = self.engines[engine_id]
        existing = None if existing_id is None else self.prefixes[existing_id]
        prefix, first = engine.prefill(params=engine.load_params(), tokens=tokens, sampling=sampling,
                                       existing_prefix=existing, token_mask=token_mask)
        self.prefixes[prefix_id] = prefix
        return None if self.rank else self._answer(engine, prefix, first)

    def prefill_batch(self, engine_id: str, prefix_ids: Sequence[str], entries: Sequence[tuple]) -> list | None:
        """Every entry ``(tokens, sampling, existing_id, token_mask)`` in one
        ``prefill_batch`` of the engine; rank 0 returns each entry's answer as :meth:`prefill`."""
        from polyengine.engine import PrefillRequest

        engine = self.engines[engine_id]
        requests = [PrefillRequest(tokens=tokens, sampling=sampling, token_mask=mask,
                                   existing_prefix=None if existing is None else self.prefixes[existing])
                    for tokens, sampling, existing, mask in entries]
        out = engine.prefill_batch(params=engine.load_params(), requests=requests)
        for prefix_id, (prefix, _) in zip(prefix_ids, out):
            self.prefixes[prefix_id] = prefix
        return None if self.rank else [self._answer(engine, prefix, first) for prefix, first in out]

    def _answer(self, engine, prefix, first) -> tuple:
        """Rank 0's answer for a prefill: the first token's packed row, the prefix's bytes
        and, on pages, its page ids and length."""
        return self._packed(engine, first), prefix.nbytes, self._seq(engine, prefix)

    @staticmethod
    def _seq(engine, prefix) -> tuple[list[int], int] | None:
        """A paged engine's prefix as page ids and a length (a prefix's never change)."""
        if engine.pages is None:
            return None
        seq = engine.prefix_pages(prefix)
        return list(seq.pages), seq.length

    def pages(self, engine_id: str, state_id: str | None) -> dict[str, Any] | None:
        """Rank 0's page pool: every page's count by id and, with ``state_id``, each
        occupied slot's page ids and length. Every rank holds the same pool (they run the
        same calls in the same order), so one answers; a host read, no collective."""
        if self.rank:
            return None
        engine = self.engines[engine_id]
        slots = {}
        if state_id is not None:
            for slot, seq in enumerate(self.states[state_id].seqs or ()):
                if seq is not None:
                    slots[slot] = (list(seq.pages), seq.length)
        return {"counts": engine.pages.counts(), "slots": slots}

    def prefix_logits(self, prefix_id: str) -> np.ndarray | None:
        return None if self.rank else self.prefixes[prefix_id].host_logits()

    def insert(self, engine_id: str, prefix_id: str, state_id: str, slot: int) -> None:
        self.states[state_id] = self.engines[engine_id].insert(self.prefixes[prefix_id], self.states[state_id], slot)

    def bulk_insert(self, engine_id: str, prefix_id: str, state_id: str, slots: Sequence[int]) -> np.ndarray | None:
        engine = self.engines[engine_id]
        self.states[state_id], first = engine.bulk_insert(self.prefixes[prefix_id], self.states[state_id], slots)
        return self._packed(engine, first)

    def generate(self, engine_id: str, state_id: str, overrides: Mapping[int, Any],
                 token_masks: Mapping[int, np.ndarray] | None = None) -> np.ndarray | None:
        engine = self.engines[engine_id]
        self.states[state_id], result = engine.generate(engine.load_params(), self.states[state_id], overrides=overrides,
                                                        token_masks=token_masks)
        return self._packed(engine, result)

    def free(self, engine_id: str, state_id: str, slot: int) -> None:
        self.states[state_id] = self.engines[engine_id].free_resource(self.states[state_id], slot)

    def export_prefix(self, engine_id: str, prefix_id: str) -> bytes | None:
        portable = self.engines[engine_id].export_prefix(self.prefixes[prefix_id])  # gathers: every rank runs it
        return None if self.rank else portable.to_bytes()

    def import_prefix(self, engine_id: str, prefix_id: str, data: bytes) -> np.ndarray | None:
        from polyengine.prefix import PortablePrefix

        engine = self.engines[engine_id]
        prefix = engine.import_prefix(PortablePrefix.from_bytes(data))
        self.prefixes[prefix_id] = prefix
        return self._imported(engine, prefix)

    def _imported(self, engine, prefix) -> tuple[np.ndarray, tuple[list[int], int] | None] | None:
        """Rank 0's answer for an imported prefix: its first token and bytes, and its pages."""
        return None if self.rank else (np.asarray([prefix.first_token, prefix.nbytes], np.int64),
                                       self._seq(engine, prefix))

    def import_prefix_tail(self, engine_id: str, prefix_id: str, data: bytes,
                           existing_id: str) -> tuple[np.ndarray, tuple[list[int], int] | None] | None:
        """A portable prefix's tail imported onto the prefix held as ``existing_id`` (the
        engine's own import_prefix_tail: on pages, the head's pages shared); rank 0
        returns its first token and bytes, and its pages."""
        from polyengine.prefix import PortablePrefix

        engine = self.engines[engine_id]
        prefix = engine.import_prefix_tail(PortablePrefix.from_bytes(data), existing_prefix=self.prefixes[existing_id])
        self.prefixes[prefix_id] = prefix
        return self._imported(engine, prefix)

    # -- disaggregated serving: prefixes as portable bytes through the object store -------

    def prefill_portable(self, engine_id: str, tokens: np.ndarray, sampling,
                         existing: bytes | None = None, token_mask: np.ndarray | None = None
                         ) -> tuple[np.ndarray | None, bytes]:
        """Prefill and export at once (a prefill worker): the first token's packed row
        for the leader and the portable prefix's safetensors bytes for the object store
        (the caller asks for two returns, so the bytes stay there until a decode worker
        needs them). The device copy is dropped. ``existing``: a portable prefix's bytes
        (Ray hands them over from the object store) that the tokens continue."""
        from polyengine.prefix import PortablePrefix

        engine = self.engines[engine_id]
        head = None if existing is None else engine.import_prefix(PortablePrefix.from_bytes(existing))
        prefix, first = engine.prefill(params=engine.load_params(), tokens=tokens, sampling=sampling,
                                       existing_prefix=head, token_mask=token_mask)
        return self._packed(engine, first), engine.export_prefix(prefix).to_bytes()

    def insert_portable(self, engine_id: str, state_id: str, slots: Sequence[int], data: bytes, bulk: bool,
                        token_mask: np.ndarray | None = None):
        """Import a portable prefix (Ray hands over the bytes from the object store) and
        insert it: into ``slots[0]`` (insert) or every slot (bulk_insert, each sample's
        first token drawn under ``token_mask``, the mask its prefill had)."""
        from polyengine.prefix import PortablePrefix

        engine = self.engines[engine_id]
        prefix = engine.import_prefix(PortablePrefix.from_bytes(data))
        prefix.token_mask = token_mask
        if not bulk:
            self.states[state_id] = engine.insert(prefix, self.states[state_id], slots[0])
            return None
        self.states[state_id], first = engine.bulk_insert(prefix, self.states[state_id], slots)
        return self._packed(engine, first)

    def first_token(self, engine_id: str, data: bytes) -> int:
        """Sample 0's first token of a portable prefix (what import_prefix computes)."""
        from polyengine.prefix import PortablePrefix

        return self.engines[engine_id].import_prefix(PortablePrefix.from_bytes(data)).first_token

    def memory_reports(self, engine_id: str) -> dict[str, Any]:
        return self.engines[engine_id].memory_reports


def _gloo_on(host: str) -> None:
    """Make JAX's gloo collectives listen on ``host`` (the Ray node's address).

    JAX creates them without a hostname, and gloo then binds to whatever this machine's
    hostname resolves to, which may be a public interface even when Ray was told to
    stay on loopback. JAX has no option for it, so the factory it calls is wrapped
    here, in this worker process only, before the CPU backend is created."""
    import functools

    from jax._src import xla_bridge

    make = xla_bridge._jax.make_gloo_tcp_collectives
    if not isinstance(make, functools.partial):
        xla_bridge._jax.make_gloo_tcp_collectives = functools.partial(make, hostname=host)
