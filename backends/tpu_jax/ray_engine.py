"""tpu_jax_ray: the protocol on a leader that drives one Ray actor per host.

The actors (:mod:`.ray_worker`) form one JAX program (``jax.distributed``) and each
hosts the same single-host engine, so the weights and the KV cache are sharded over
every host's devices by the same rules, and the decode state never leaves them. This
leader is an :class:`~polyengine.engine.EngineBase`: it makes every refusal itself,
before any remote work, then sends each call to every actor (they must all run it, in
the same order, for the collectives inside the steps) and reads rank 0's answer, which
is host data only. The conformance suite and the driver run on it unchanged.

Handles: ``load_params`` returns the engine's id, ``Prefix.kv`` and the decode state
name objects the actors hold, dropped on the actors when the leader's handle goes.

Failure: a worker that dies (its process killed, its node gone) fails the call in
flight with :class:`WorkerLost` as soon as Ray reports the actor dead, never later than
``step_timeout_s``; the other workers, possibly stuck in a collective with the dead
one, are killed, and every later call on this engine raises the same error at once.
A new engine starts a new set of workers.

Placement: on a cluster whose nodes carry Ray's ``TPU`` resource (TPU VMs register
their chips as it), each worker takes one host's chips (``resources={"TPU": chips}``)
and a ``STRICT_SPREAD`` placement group puts exactly one worker on each TPU host, so
each process of the JAX program owns its host's chips. Elsewhere a worker takes one
CPU, as a CPU JAX process needs (``spread_workers`` still spreads them over nodes).

Memory: each host holds only its workers' share of the weights and the KV cache, so
the leader checks per Ray node, before any worker allocates, the bytes that node's
workers will hold (:func:`.footprint.device_needs` times the devices of each) against
the memory those workers report free. On TPU those shares live in the chips' HBM,
which each worker checks against its devices' free memory when it builds its engine.
The leader's own host holds no weights or caches and is not checked against them.

Workers are kept per (cluster, worker count, devices, resources, placement) and reused
by the next engine (the conformance suite builds many): starting one costs a Python
process with JAX and torch imported, and reused ones keep their compiled programs.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
import uuid
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from polyengine.engine import (
    Capabilities, EngineBase, EngineConfig, Option, Override, Prefix, PrefillRequest, ResultLayout, ResultTokens,
    SlotTable,
)
from polyengine.errors import EngineDead, InvalidRequest, PolyengineError, UnsupportedFeature
from polyengine.models import Model
from polyengine.models.int_blocks import block_matrices
from polyengine.pages import PageList, PagePool
from polyengine.prefix import PortablePrefix
from polyengine.sampling import SamplingParams
from polyengine.sampling.params import ENGINE_FIELDS, MAX_TOP_LOGPROBS

from polyengine.backends.tpu_jax.disagg import PortableHandle, PrefillPool
from polyengine.backends.tpu_jax.footprint import device_needs, mesh_shape
from polyengine.backends.tpu_jax.options import (
    BATCHED_PREFILL_PLATFORMS, OPTIONS as ENGINE_OPTIONS, WEIGHT_FORMATS, check_pages,
)

__all__ = ["RayTpuEngine", "RayDecodeState", "WorkerLost", "WorkerGroup", "create_engine", "start_local_ray"]

_LAYOUT = ResultLayout(k=1, top_n=MAX_TOP_LOGPROBS, logprobs=True)


class WorkerLost(EngineDead):
    """A worker of a multi-host engine died or stopped answering; the engine is unusable
    (an :class:`EngineDead`: the driver fails every request and a server's ``/health``
    answers 503)."""


def start_local_ray(**kwargs: Any) -> None:
    """Start a Ray instance on this machine that listens on loopback only.

    Ray binds its servers to the machine's external address unless
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps every listener on 127.0.0.1 (read
    when ray is imported, so it is set first); ``RAY_AUTH_MODE=disabled`` stops it
    writing a token under ``~/.ray``. The workers' JAX coordinator and gloo transport
    follow the node address, so the whole engine stays on loopback.
    """
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:
        warnings.warn(
            "ray was imported before polyengine could keep it on loopback, so the local Ray instance may listen on "
            "every interface; set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing ray", stacklevel=2)
    ray.init(**{"_node_ip_address": "127.0.0.1", "include_dashboard": False, "log_to_driver": False,
                "configure_logging": False, **kwargs})


def _connect(address: str, timeout: float) -> None:
    """Join the Ray instance this process is connected to, the one at ``address`` (an
    Unreachable error after ``timeout`` seconds), or a new local one on loopback."""
    if "ray" not in sys.modules and not address:
        start_local_ray()
        return
    import ray

    if ray.is_initialized():
        return
    if address:
        from polyengine.remote import call_with_deadline, check_reachable

        check_reachable(address, timeout, "the Ray cluster (option ray_address)")
        call_with_deadline(lambda: ray.init(address=address, log_to_driver=False), timeout, address=address,
                           what="the Ray cluster (option ray_address)")
    else:
        start_local_ray()


# -- the workers --------------------------------------------------------------------------


class WorkerGroup:
    """N actors that joined one JAX program. ``call`` sends a method to all and returns
    rank 0's answer; any death turns into :class:`WorkerLost` (and kills the rest)."""

    def __init__(self, num_workers: int, devices_per_worker: int, spread: bool, timeout: float, independent: bool = False,
                 tpu: int = 0):
        """``independent``: each actor is a JAX program of its own (prefill workers)
        instead of one process of a shared one. ``tpu``: the TPU chips each worker
        takes (a whole host's: one worker per TPU host); 0 on a CPU cluster."""
        import ray

        from polyengine.backends.tpu_jax.ray_worker import EngineWorker

        self.timeout = timeout
        self.lost: str | None = None
        self.cluster = ray.get_runtime_context().gcs_address
        # Workers configure JAX as the leader's environment does (JAX_PLATFORMS, JAX_*
        # compilation settings), plus their host device count.
        env = {k: v for k, v in os.environ.items() if k.startswith("JAX_")}
        if devices_per_worker > 1 and not tpu:  # CPU host devices; a TPU host reports its chips
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices_per_worker}"
        bundle: dict[str, float] = {"CPU": 1, **({"TPU": tpu} if tpu else {})}
        options: dict[str, Any] = {"num_cpus": 1, "runtime_env": {"env_vars": env}, "max_restarts": 0}
        if tpu:
            options["resources"] = {"TPU": tpu}
        self.placement = None
        if spread or tpu:
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            self.placement = placement_group([dict(bundle)] * num_workers, strategy="STRICT_SPREAD")
            self._gather([self.placement.ready()], f"placing {num_workers} workers on distinct nodes ({bundle} each)")
        actor = ray.remote(EngineWorker)
        self.workers = []
        for rank in range(num_workers):
            opts = dict(options)
            if self.placement is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank)
            self.workers.append(actor.options(**opts).remote(0, 1) if independent else actor.options(**opts).remote(rank, num_workers))
        coordinator = "" if independent else self._gather([self.workers[0].coordinator_address.remote()], "starting the workers")[0]
        self.info = self._gather([w.join.remote(coordinator) for w in self.workers], "joining the JAX program")

    def _gather(self, refs: Sequence[Any], what: str) -> list[Any]:
        """Wait for every ref; a dead actor or a timeout is WorkerLost, a remote
        exception is re-raised as what it was (typed polyengine errors stay typed)."""
        import ray

        if self.lost:
            raise WorkerLost(self.lost)
        deadline = time.monotonic() + self.timeout
        pending = list(refs)
        while pending:
            # Short waits, so a worker that died is noticed while the others still work
            # (or wait for it forever inside a collective).
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.25)
            for ref in ready:
                self._check(ref, what)
            if pending and time.monotonic() > deadline:
                self._lose(f"no answer from {len(pending)} worker(s) within {self.timeout:.0f} s while {what}")
        return [self._check(ref, what) for ref in refs]

    def _check(self, ref, what: str) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(ref, timeout=0)
        except RayActorError as exc:
            self._lose(f"a worker died while {what}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        except RayTaskError as exc:
            cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else None
            if isinstance(cause, PolyengineError):
                raise cause from None
            # A survivor's collective fails (gloo: connection reset) before Ray reports
            # the dead peer: if a worker is gone, that is the error, not the symptom.
            dead = self._dead_worker()
            if dead is not None:
                self._lose(f"a worker died while {what} ({dead}; a survivor saw {type(cause or exc).__name__}: "
                           f"{str(cause or exc).splitlines()[-1][:200]})")
            raise exc.as_instanceof_cause() from None
        except GetTimeoutError:  # pragma: no cover - ray.wait said it was ready
            raise

    def _dead_worker(self, timeout: float = 2.0) -> str | None:
        """Which worker is dead (after a remote error), found by a no-op call to each."""
        import ray
        from ray.exceptions import RayActorError

        refs = [w.drop.remote("prefixes", "") for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for rank, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref, timeout=0)
                except RayActorError as exc:
                    return f"rank {rank}: {type(exc).__name__}"
        return None

    def _lose(self, why: str) -> None:
        self.lost = f"{why} (Ray cluster at {self.cluster}); the engine's workers are gone: build a new engine"
        self.kill()
        raise WorkerLost(self.lost)

    def kill(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already dead
                pass
        if self.placement is not None:
            try:
                ray.util.remove_placement_group(self.placement)
            except Exception:
                pass

    def submit(self, method: str, *args: Any) -> list[Any]:
        if self.lost:
            raise WorkerLost(self.lost)
        return [getattr(w, method).remote(*args) for w in self.workers]

    def call(self, method: str, *args: Any, what: str | None = None) -> Any:
        return self._gather(self.submit(method, *args), what or f"running {method}")[0]

    def submit_one(self, index: int, method: str, *args: Any, num_returns: int = 1) -> Any:
        """One worker's call (independent workers): its ref, or refs with num_returns > 1."""
        if self.lost:
            raise WorkerLost(self.lost)
        return getattr(self.workers[index], method).options(num_returns=num_returns).remote(*args)

    def alive(self) -> bool:
        """Not lost, and its Ray instance still the one this process is connected to."""
        import ray

        return not self.lost and ray.is_initialized() and ray.get_runtime_context().gcs_address == self.cluster

    def drop(self, kind: str, key: str) -> None:
        """Forget an engine, state or prefix on every worker (best effort, no wait).
        Called when the leader's handle is collected: it must never start Ray again."""
        if self.alive():
            try:
                self.submit("drop", kind, key)
            except Exception:
                pass


_groups: dict[tuple, WorkerGroup] = {}
_groups_lock = threading.Lock()


def _group(num_workers: int, devices_per_worker: int, spread: bool, timeout: float, independent: bool = False,
           tpu: int = 0) -> WorkerGroup:
    import ray

    key = (ray.get_runtime_context().gcs_address, num_workers, devices_per_worker, spread, independent, tpu)
    with _groups_lock:
        for stale in [k for k, g in _groups.items() if not g.alive()]:
            del _groups[stale]
        group = _groups.get(key)
        if group is None:
            group = _groups[key] = WorkerGroup(num_workers, devices_per_worker, spread, timeout, independent, tpu)
        group.timeout = timeout
        return group


# -- the leader ---------------------------------------------------------------------------


@dataclass
class RayDecodeState:
    """The leader's decode state: an id the workers hold the arrays by, and the host
    mirror of the slots that the refusals need."""

    num_slots: int
    state_id: str
    slots: SlotTable

    def is_occupied(self, slot: int) -> bool:
        return self.slots.is_occupied(slot)


@dataclass(eq=False)
class RemotePrefix:
    """``Prefix.kv`` of this engine: the id the workers hold the prefix by, and on pages
    the page ids it holds there (a prefix's pages never change)."""

    prefix_id: str
    seq: PageList | None = None


class RemotePages:
    """The leader's view of the K/V page pool its workers hold (``engine.pages`` of a paged
    tpu_jax_ray engine). Every worker holds the same pool, since all run the same calls in
    the same order; this view reads rank 0's counts (and a decode state's page lists) with
    one call after the leader sent anything that may change them, and answers from that
    copy until it sends another (:meth:`changed`, called after each such call is sent:
    Ray runs them in order, so the read sees every change sent before it). The counts are
    PagePool's reads; the pages are taken, shared and released on the workers only."""

    def __init__(self, group: "WorkerGroup", engine_id: str, page_size: int, capacity: int | None):
        self.page_size, self.capacity = int(page_size), capacity
        self._group, self._engine_id = group, engine_id
        self._version = 0
        self._copy: tuple[int, str | None, PagePool, dict[int, PageList]] | None = None
        self.lock = threading.RLock()

    def changed(self) -> None:
        """A call that may change the pool was sent: the next read asks rank 0 again."""
        with self.lock:
            self._version += 1

    def read(self, state_id: str | None = None) -> tuple[PagePool, dict[int, PageList]]:
        """The pool's counts (a PagePool copy) and, with ``state_id``, that decode state's
        occupied slots' page lists, as rank 0 has them after every call sent so far."""
        with self.lock:
            version, copy = self._version, self._copy
            if copy is not None and copy[0] == version and (state_id is None or copy[1] == state_id):
                return copy[2], copy[3]
        ref = self._group.submit_one(0, "pages", self._engine_id, state_id)
        answer = self._group._gather([ref], "reading the K/V page pool")[0]
        pool = PagePool.from_counts(self.page_size, self.capacity, answer["counts"])
        slots = {int(s): PageList(pool, pages, length) for s, (pages, length) in answer["slots"].items()}
        with self.lock:
            self._copy = (version, state_id, pool, slots)
        return pool, slots

    @property
    def allocated(self) -> int:
        return self.read()[0].allocated

    @property
    def held(self) -> int:
        return self.read()[0].held

    @property
    def free(self) -> int | None:
        return self.read()[0].free

    @property
    def shared(self) -> int:
        return self.read()[0].shared

    def refcount(self, page: int) -> int:
        return self.read()[0].refcount(page)


def _drop(group: "WorkerGroup", pages: RemotePages | None, kind: str, key: str) -> None:
    """A handle's finalizer: forget what it names on the workers; a prefix's or a
    state's pages go back to the pool there."""
    group.drop(kind, key)
    _changed(pages)


def _changed(pages: RemotePages | None) -> None:
    """A call that may change the workers' pool was sent (RemotePages.changed), if paged."""
    if pages is not None:
        pages.changed()


def _prompt(tokens: np.ndarray, existing_prefix: Prefix | None) -> np.ndarray:
    """A prefill's whole prompt: the continued prefix's tokens, then ``tokens``."""
    if existing_prefix is None:
        return tokens
    return np.concatenate([existing_prefix.prompt_tokens, tokens]).astype(np.int32)


class RayTpuEngine(EngineBase):
    name = "tpu_jax_ray"
    # The single-host engine's options (forwarded to every worker's engine, checked here
    # first with the same JAX-free table), plus the leader's own.
    OPTIONS = {
        # batched_prefill included: the leader's prefill_batch is one call of the workers' engines'
        **ENGINE_OPTIONS,
        "num_workers": Option(0, "Ray actors, one per host: the processes of the JAX program; 0 = one per TPU "
                                 "host where the cluster has TPUs, else 2", minimum=0),
        "devices_per_worker": Option(1, "CPU only: host devices each worker's JAX shows (a TPU worker takes its "
                                        "host's chips)", minimum=1),
        "spread_workers": Option(False, "one worker per Ray node (a STRICT_SPREAD placement group; always on TPU)"),
        "accelerator": Option("auto", "'auto': workers take Ray's TPU resource where the cluster has it, else a "
                                      "CPU; 'tpu': require TPU hosts; 'cpu': never ask for TPUs",
                              choices=("auto", "tpu", "cpu")),
        "step_timeout_s": Option(600.0, "longest wait for any call (the first ones compile)", check=lambda v: (
            None if v > 0 else "must be > 0")),
        "ray_address": Option("", "'' joins the running Ray instance or starts a local, loopback-only one"),
        "connect_timeout_s": Option(30.0, "joining ray_address: refused, unroutable or silent ends in Unreachable",
                                    check=lambda v: None if v > 0 else "must be > 0"),
        "prefill_workers": Option(0, "> 0: disaggregated, prompts prefill on these actors (disagg.py), not the "
                                     "decode workers", minimum=0),
    }

    def _check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The table's checks before any worker starts (the paged K/V options' against the
        context: :meth:`capabilities_for`); pages with prefill workers are refused: their
        prefixes travel whole through the object store (docs/tpu_jax.md); so is
        batched_prefill 'on' with them: they prefill one entry a call."""
        checked = super()._check_options(options)
        if checked["page_size"] and checked["prefill_workers"]:
            raise UnsupportedFeature(f"option page_size={checked['page_size']} with prefill_workers", self.name,
                                     "disaggregated prefixes travel whole through the object store and are "
                                     "imported into each slot; leave page_size 0 or prefill_workers 0",
                                     field="options.page_size")
        if checked["batched_prefill"] == "on" and checked["prefill_workers"]:
            raise UnsupportedFeature("option batched_prefill='on' with prefill_workers", self.name,
                                     "the prefill workers prefill one entry a call; leave batched_prefill 'auto' "
                                     "(off with prefill workers) or prefill_workers 0",
                                     field="options.batched_prefill")
        return checked

    def __init__(self, model: Model, config: EngineConfig):
        super().__init__(model, config, device="")
        import ray

        self._check_hosts(model, config)
        options, group = self.options, self.group
        # The workers' engines batch prefills where the leader declares it (their batch programs
        # then warm up with them); the prefill workers prefill one entry a call.
        forwarded = {k: v for k, v in options.items() if k in ENGINE_OPTIONS}
        worker_config = config.model_copy(update={"options": {
            **forwarded, "batched_prefill": "on" if self.capabilities.batched_prefill else "off"}})
        prefill_config = config.model_copy(update={"options": {**forwarded, "batched_prefill": "off"}})
        model_ref = ray.put(model)
        self.engine_id = uuid.uuid4().hex
        self.device = group.call("build", self.engine_id, model_ref, worker_config, what="building the engine") + (
            f" on {len(group.workers)} Ray workers")
        self._finalizer = weakref.finalize(self, group.drop, "engines", self.engine_id)
        ps = options["page_size"]
        # Paged K/V (option page_size): the workers' engines keep the pages; the leader reads
        # their counts and lists (RemotePages), for the driver's admission and prefix cache.
        self.pages = RemotePages(group, self.engine_id, ps, options["kv_pages"] or None) if ps else None
        self._ids = itertools.count()
        self.prefill_pool: PrefillPool | None = None
        if options["prefill_workers"]:
            self.prefill_pool = PrefillPool(
                _group(options["prefill_workers"], options["devices_per_worker"], False, float(options["step_timeout_s"]),
                       independent=True, tpu=self.tpu), self.engine_id, model_ref, prefill_config)
            weakref.finalize(self, self.prefill_pool.group.drop, "engines", self.engine_id)
            self.device += f", prefill on {options['prefill_workers']} more (disaggregated)"

    def capabilities_for(self, model: Model, config: EngineConfig) -> Capabilities:
        """The workers' layout (TPU hosts or CPUs) and the mesh they will form, checked
        before any starts; then the workers start, each host's share is checked against
        the memory its workers report, and they report their platform's dtypes."""
        o = self.options
        check_pages(o, config.max_cache_length, self.name)
        _connect(o["ray_address"], float(o["connect_timeout_s"]))
        self.tpu, workers = self._layout(o)
        # The mesh the workers will form, refused here (naming both numbers) before any starts.
        mesh_shape(model.config, config.max_slots, workers * (self.tpu or o["devices_per_worker"]),
                   tensor_parallel=o["tensor_parallel"], data_parallel=o["data_parallel"],
                   platform="tpu" if self.tpu else "cpu")
        self.group = _group(workers, o["devices_per_worker"], o["spread_workers"], float(o["step_timeout_s"]),
                            tpu=self.tpu)
        caps = self.group.call("capabilities")
        self.platform = caps["platform"]
        return Capabilities(
            dtypes=tuple(caps["dtypes"]), sampling_params=ENGINE_FIELDS, max_top_logprobs=MAX_TOP_LOGPROBS,
            bulk_insert=True, portable_prefix=True, prefix_reuse=True, async_results=True, token_masks=True,
            prefix_truncate=True,  # the kit's cut through export/import, as the workers' own engines do it
            # a tail onto a held prefix: on pages the workers' engines share its pages
            # (_import_onto_pages); contiguous, the kit's copy through export/import
            portable_prefix_tail=True,
            weight_formats=WEIGHT_FORMATS,  # the workers' engines compute on them (docs/tpu_jax.md)
            # disaggregated: a prefill runs on the prefill workers, so the kit's lane thread
            # only waits for them while the driver steps the decode workers
            prefill_lane=bool(o["prefill_workers"]),
            page_size=o["page_size"],  # the workers' engines' pages (RemotePages reads them)
            # one prefill_batch of the workers' engines (option batched_prefill, as tpu_jax
            # resolves it); not with prefill workers, which prefill one entry a call
            batched_prefill=not o["prefill_workers"] and (o["batched_prefill"] == "on" or (
                o["batched_prefill"] == "auto" and self.platform in BATCHED_PREFILL_PLATFORMS)),
        )

    def _layout(self, o: Mapping[str, Any]) -> tuple[int, int]:
        """``(TPU chips per worker, workers)``: on a cluster with Ray's ``TPU`` resource
        (option ``accelerator``), one worker per TPU host taking all its chips; else
        CPU workers (0 chips), ``num_workers`` of them (0: 2)."""
        import ray

        hosts = [n["Resources"]["TPU"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get("TPU", 0) > 0]
        if o["accelerator"] == "cpu" or (o["accelerator"] == "auto" and not hosts):
            return 0, o["num_workers"] or 2
        if not hosts:
            raise InvalidRequest("option accelerator='tpu', but no node of the Ray cluster has the 'TPU' resource "
                                 "(Ray registers a TPU VM's chips as it); run on TPU hosts or use accelerator='cpu'")
        workers = o["num_workers"] or len(hosts) - o["prefill_workers"]
        if workers < 1 or workers + o["prefill_workers"] > len(hosts):
            raise InvalidRequest(
                f"options num_workers={o['num_workers']} and prefill_workers={o['prefill_workers']} need more TPU hosts "
                f"than the Ray cluster's {len(hosts)}: each worker takes one whole host; use fewer")
        return int(min(hosts)), workers

    def _check_hosts(self, model: Model, config: EngineConfig) -> None:
        """Refuse, before any worker allocates, a node whose workers' share does not fit
        the host memory they report. Only the CPU platform keeps the shares in host
        memory; on TPU and GPU each worker checks its own devices' free memory for its
        share when it builds its engine."""
        if self.platform != "cpu":
            return
        o, info = self.options, self.group.info
        dp, tp = mesh_shape(model.config, config.max_slots, info[0]["devices"], tensor_parallel=o["tensor_parallel"],
                            data_parallel=o["data_parallel"], platform=self.platform)
        blocks = {} if o["quantize"] else {s: model.records[s].format
                                           for s in block_matrices(model, WEIGHT_FORMATS).values()}
        per_device = device_needs(model.config, config, dtype=self.dtype, dp=dp, tp=tp, quantize=o["quantize"],
                                  kv_int8=o["kv_quantize"] == "int8", rules=o["sharding_rules"], blocks=blocks,
                                  page_size=o["page_size"], pool_pages=o["kv_pages"])
        reports = self.group._gather(self.group.submit("host_memory"), "asking the workers for their free memory")
        nodes: dict[str, list[dict]] = {}
        for worker, report in zip(info, reports):
            nodes.setdefault(worker["node"], []).append({**worker, **report})
        for node, workers in nodes.items():
            # Devices of the mesh this node's workers hold (a process may see more than the mesh uses).
            count = min(sum(w["local_devices"] for w in workers), dp * tp)
            free = [w["available"] for w in workers if w["available"] is not None]
            self.check_memory({f"{what} ({len(workers)} worker(s), {count} device(s))": n * count
                               for what, n in per_device.items()},
                              where=f"host memory of Ray node {workers[0]['address']} ({node[:12]})",
                              available=min(free) if free else None)

    def _id(self, kind: str) -> str:
        return f"{self.engine_id}-{kind}{next(self._ids)}"

    # -- lifecycle -------------------------------------------------------------------------

    def load_params(self) -> str:
        self.group.call("load", self.engine_id, what="loading the weights")
        if self.prefill_pool is not None:
            self.prefill_pool.load()
        return self.engine_id

    def warmup(self) -> None:
        self.group.call("warmup", self.engine_id, what="warming up")
        if self.prefill_pool is not None:
            self.prefill_pool.warmup()

    def memory_reports(self) -> dict[str, Any]:
        return self.group.call("memory_reports", self.engine_id)

    def init_decode_state(self) -> RayDecodeState:
        state_id = self._id("state")
        self.group.call("init_state", self.engine_id, state_id)
        n = self.max_concurrent_decodes
        state = RayDecodeState(n, state_id, SlotTable(n))
        weakref.finalize(state, _drop, self.group, self.pages, "states", state_id)
        return state

    # -- prefixes --------------------------------------------------------------------------

    def _prefix(self, prefix_id: str, prompt: np.ndarray, sampling: SamplingParams, first: int, nbytes: int,
                token_mask: np.ndarray | None = None, seq: tuple[list[int], int] | None = None) -> Prefix:
        """The handle of what the workers hold as ``prefix_id`` (``seq``: its page ids and
        length on a paged engine, as rank 0 answered)."""
        handle = RemotePrefix(prefix_id, None if seq is None else PageList(self.pages, seq[0], seq[1]))
        weakref.finalize(handle, _drop, self.group, self.pages, "prefixes", prefix_id)
        return Prefix(kv=handle, logits=handle, prompt_tokens=prompt, sampling=sampling, backend=self.name,
                      first_token=first, to_host=self._logits, model_id=self.model_id, nbytes=nbytes,
                      token_mask=token_mask)

    def _logits(self, handle: RemotePrefix) -> np.ndarray:
        return self.group.call("prefix_logits", handle.prefix_id)

    def _check_params(self, params: Any) -> None:
        if params != self.engine_id:
            raise InvalidRequest("params are not this engine's (pass what its load_params() returned)")

    def prefill(self, *, params, tokens, sampling: SamplingParams, existing_prefix: Prefix | None = None,
                token_mask: np.ndarray | None = None):
        self._check_params(params)
        toks, sampling, _ = self.check_prefill(tokens, sampling, existing_prefix)
        mask = self.check_token_mask(token_mask, sampling)
        prompt = _prompt(toks, existing_prefix)
        if self.prefill_pool is not None:
            head = None if existing_prefix is None else self._portable_handle(existing_prefix)
            packed, ref = self.prefill_pool.prefill(toks, sampling, head, mask)
            result = ResultTokens.from_packed(packed, _LAYOUT)
            return self._portable_prefix(PortableHandle(ref), prompt, sampling, int(result.tokens[0, 0]), mask), result
        prefix_id = self._id("prefix")
        head = None if existing_prefix is None else existing_prefix.kv.prefix_id
        packed, nbytes, seq = self._call("prefill", self.engine_id, prefix_id, toks, sampling, head, mask)
        result = ResultTokens.from_packed(packed, _LAYOUT)
        return self._prefix(prefix_id, prompt, sampling, int(result.tokens[0, 0]), nbytes, mask, seq), result

    def prefill_batch(self, *, params, requests: Sequence[PrefillRequest]) -> list[tuple[Prefix, ResultTokens]]:
        """Every entry in one ``prefill_batch`` call of the workers' engines (one forward
        over the entries, capability ``batched_prefill``); without the capability the kit's
        ``prefill`` per entry. A refused entry prefills nothing (checked here first)."""
        if not self.capabilities.batched_prefill:
            return super().prefill_batch(params=params, requests=requests)
        self._check_params(params)
        checked = self.check_prefill_batch(requests)
        ids = [self._id("prefix") for _ in requests]
        entries = [(toks, sampling, None if req.existing_prefix is None else req.existing_prefix.kv.prefix_id, mask)
                   for req, (toks, sampling, _, mask) in zip(requests, checked)]
        answers = self._call("prefill_batch", self.engine_id, ids, entries)
        out = []
        for req, (toks, sampling, _, mask), prefix_id, (packed, nbytes, seq) in zip(requests, checked, ids, answers):
            result = ResultTokens.from_packed(packed, _LAYOUT)
            prefix = self._prefix(prefix_id, _prompt(toks, req.existing_prefix), sampling, int(result.tokens[0, 0]),
                                  nbytes, mask, seq)
            out.append((prefix, result))
        return out

    def _call(self, method: str, *args: Any) -> Any:
        """Every worker runs ``method``; rank 0's answer. On pages, the leader's copy of the
        pool's counts is stale from then on (RemotePages.changed)."""
        try:
            return self.group.call(method, *args)
        finally:
            _changed(self.pages)

    def _portable_handle(self, prefix: Prefix) -> "PortableHandle":
        """A disaggregated engine's prefixes are all portable bytes in the object store."""
        assert isinstance(prefix.kv, PortableHandle), "check_prefix admits only this engine's prefixes"
        return prefix.kv

    def _portable_prefix(self, handle: "PortableHandle", prompt, sampling, first: int,
                         token_mask: np.ndarray | None = None) -> Prefix:
        # The object store holds the float32 K/V of the prompt's positions.
        return Prefix(kv=handle, logits=handle, prompt_tokens=prompt, sampling=sampling, backend=self.name,
                      first_token=first, to_host=lambda h: h.portable().last_logits, model_id=self.model_id,
                      nbytes=prompt.size * self.model.config.kv_bytes_per_token(4), token_mask=token_mask)

    # -- insert, bulk_insert, free_resource: the kit's flow (refusals here), the work remote --

    def _install(self, prefix: Prefix, state: RayDecodeState, slots: list[int], *, draw: bool) -> ResultTokens | None:
        if isinstance(prefix.kv, PortableHandle):  # every decode worker reads it from the object store
            packed = self._call("insert_portable", self.engine_id, state.state_id, slots, prefix.kv.ref, draw,
                                     prefix.token_mask)
        elif draw:
            packed = self._call("bulk_insert", self.engine_id, prefix.kv.prefix_id, state.state_id, slots)
        else:
            packed = self._call("insert", self.engine_id, prefix.kv.prefix_id, state.state_id, slots[0])
        return ResultTokens.from_packed(packed, _LAYOUT) if draw else None

    def _release(self, state: RayDecodeState, slot: int) -> None:
        self._call("free", self.engine_id, state.state_id, slot)

    # -- generate --------------------------------------------------------------------------

    def generate(self, params, decode_state: RayDecodeState, *, overrides: Mapping[int, Any] | None = None,
                 token_masks: Mapping[int, np.ndarray] | None = None):
        self._check_params(params)
        state = decode_state
        forced = self.check_overrides(overrides, state.slots.last_result)
        masks = self.check_token_masks(token_masks, state.slots.last_result, forced=forced,
                                       sampling_of=state.slots.sampling)
        state.slots.advance(state.slots.live(self.max_cache_length))
        refs = self.group.submit("generate", self.engine_id, state.state_id,
                                 {s: Override(t, p) for s, (t, p) in forced.items()},
                                 None if masks is None else {i: masks.words[i] for i in masks.slots})
        _changed(self.pages)
        # Results are read when the driver reads them: step n+1 is sent before then.
        return state, ResultTokens.from_packed(refs, _LAYOUT, to_host=lambda r: self.group._gather(r, "generating")[0])

    # -- portable prefixes ---------------------------------------------------------------

    def export_prefix(self, prefix: Prefix) -> PortablePrefix:
        self.check_prefix(prefix).require_logits("export_prefix")
        if isinstance(prefix.kv, PortableHandle):
            return prefix.kv.portable()
        return PortablePrefix.from_bytes(self.group.call("export_prefix", self.engine_id, prefix.kv.prefix_id))

    def import_prefix(self, portable: PortablePrefix) -> Prefix:
        prompt, sampling = self.check_portable(portable)
        if self.prefill_pool is not None:
            handle = self.prefill_pool.put(portable)
            return self._portable_prefix(handle, prompt, sampling, self.prefill_pool.first_token(handle))
        return self._imported("import_prefix", prompt, sampling, portable)

    def _import_onto_pages(self, portable: PortablePrefix, existing_prefix: Prefix) -> Prefix:
        """EngineBase._import_onto_pages (pages only, as the kit calls it): every worker's
        engine imports the tail onto the prefix it holds, sharing its pages below the start."""
        return self._imported("import_prefix_tail", portable.prompt_tokens, portable.sampling, portable,
                              existing_prefix.kv.prefix_id)

    def _imported(self, method: str, prompt, sampling, portable: PortablePrefix, *head: str) -> Prefix:
        """The workers' ``method`` (import_prefix, or import_prefix_tail onto the prefix held
        as ``head``) of ``portable``, as a handle."""
        prefix_id = self._id("prefix")
        first, seq = self._call(method, self.engine_id, prefix_id, portable.to_bytes(), *head)
        return self._prefix(prefix_id, prompt, sampling, int(first[0]), int(first[1]), seq=seq)

    # -- pages (option page_size): the workers' pool, as rank 0 holds it ---------------------

    def prefix_pages(self, prefix: Prefix) -> PageList:
        if self.pages is None:
            return super().prefix_pages(prefix)
        return self.check_prefix(prefix).kv.seq

    def slot_pages(self, decode_state: RayDecodeState, slot: int) -> PageList | None:
        if self.pages is None:
            return super().slot_pages(decode_state, slot)
        return self.pages.read(decode_state.state_id)[1].get(self.check_slot(slot))


def create_engine(*, model: Model, config: EngineConfig) -> RayTpuEngine:
    return RayTpuEngine(model, config)
