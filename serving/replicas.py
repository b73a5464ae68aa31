"""Replicas on Ray Serve: N engines behind one HTTP endpoint.

Each replica hosts the same FastAPI app as the standalone server (``serve.ingress``
with a builder that runs inside the replica) and builds its own AsyncLLM from the
:class:`ServerConfig` when it starts, so weights load in the replica's process, never
through Ray's object store. Ray Serve's proxy listens on ``--host``/``--port`` and
routes each request to a replica. Responses carry ``x-polyengine-replica`` (the
replica's id); ``/metrics`` is the metrics of whichever replica answers (Ray's own
metrics cover the cluster).

Bounded queue: a replica accepts more requests at once than its engine holds
(``max_slots + max_queue`` plus :data:`REJECT_HEADROOM`), so when every engine queue
is full the excess still reaches a replica, which answers 429 at once; Ray Serve's own
queue in front of the replicas (unbounded by default, and where requests wait only
while the router assigns them) is capped at what all replicas take at once, as a last
resort (Ray answers 503 beyond it). A replica whose engine died fails
Ray Serve's health check, so Ray replaces it.

Local by default: a Ray cluster started here with every listener on 127.0.0.1
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``; without it Ray binds the machine's external
interface) and token auth off unless ``RAY_AUTH_MODE`` says otherwise. With
``--ray-address`` the replicas join an existing cluster, whose settings are its own.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Callable

from polyengine.errors import InvalidRequest
from polyengine.serving.config import ServerConfig

__all__ = ["run_replicas", "deployment"]

APP_NAME = "polyengine"
# The server moves no large objects through Ray; a small store keeps a local cluster light.
LOCAL_OBJECT_STORE_BYTES = 256 << 20
# Requests a replica takes beyond what its engine holds, to refuse them itself (429):
# a refusal takes milliseconds, so this many at once is plenty.
REJECT_HEADROOM = 64
# Joining --ray-address: refused, unroutable or silent ends in an error, not a hang.
CONNECT_TIMEOUT_S = 30.0
# Until every replica has built its engine and answers (model loading included).
START_TIMEOUT_S = 600.0
# How often Ray Serve asks a replica whether its engine is alive.
HEALTH_CHECK_PERIOD_S = 5.0


def _keep_replica_grpc_on_loopback() -> None:
    """Ray Serve (2.60) binds each replica's inter-deployment gRPC server to ``[::]:0``,
    every interface, with no setting to change it. In a cluster we started on loopback,
    bind it to 127.0.0.1 instead (the node's own address there). Runs in the replica
    before Ray Serve starts that server; a Ray without the helper is left alone."""
    from ray.serve._private import replica as replica_module

    original = getattr(replica_module, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "polyengine_loopback", False):
        return

    def on_loopback(server: Any, address: str) -> Any:
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address[len("[::]:"):]
        return original(server, address)

    on_loopback.polyengine_loopback = True  # type: ignore[attr-defined]
    replica_module.add_port_to_grpc_server = on_loopback


class Replica:
    """The deployment class around the app (``serve.ingress`` adds the app as
    ``self.app``): Ray Serve calls :meth:`check_health` every few seconds and replaces a
    replica whose check raises."""

    def check_health(self) -> None:
        state = getattr(getattr(self, "app", None), "state", None)
        engine = getattr(getattr(state, "polyengine", None), "engine", None)
        if engine is not None and engine.dead is not None:
            raise RuntimeError(f"the replica's engine is dead: {engine.dead}")


def _app_builder(config: ServerConfig, loopback: bool) -> Callable[[], Any]:
    # serve.ingress runs a plain function (not a partial) inside each replica.
    def build() -> Any:
        from ray import serve

        from polyengine.serving.app import build_app

        if loopback:
            _keep_replica_grpc_on_loopback()
        replica = serve.get_replica_context().replica_id.unique_id
        return build_app(config, replica_id=replica)

    return build


def deployment(config: ServerConfig, *, replicas: int, replica_cpus: float = 1.0, loopback: bool = False) -> Any:
    """The Ray Serve application: ``replicas`` copies of the server app.

    A replica takes up to ``max_slots + max_queue + REJECT_HEADROOM`` requests at once:
    what its engine runs or queues, and room to answer the rest 429 itself. Ray
    Serve's router holds at most as many more per caller, while it assigns them. Shutdown gives in-flight
    requests ``shutdown_timeout`` seconds, as the standalone server does.
    ``loopback``: the cluster is local to this machine and must listen on 127.0.0.1 only.
    """
    from ray import serve

    ingress = serve.ingress(_app_builder(config, loopback))(Replica)
    per_replica = config.max_slots + config.max_queue + REJECT_HEADROOM
    return serve.deployment(
        ingress,
        name=APP_NAME,
        num_replicas=replicas,
        ray_actor_options={"num_cpus": replica_cpus},
        max_ongoing_requests=per_replica,
        # Requests wait here only until the router hands them to a replica; a burst
        # larger than every replica takes at once is Ray's to refuse (503).
        max_queued_requests=replicas * per_replica,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=config.shutdown_timeout,
    ).bind()


def run_replicas(config: ServerConfig, *, replicas: int, address: str | None = None, replica_cpus: float = 1.0,
                 log_level: str = "info", connect_timeout: float = CONNECT_TIMEOUT_S,
                 start_timeout: float = START_TIMEOUT_S) -> int:
    """Start (or join) a Ray cluster, run the replicas behind ``config.host:port`` until
    SIGTERM or SIGINT, then shut Serve down gracefully; the exit status."""
    if replicas < 1:
        raise InvalidRequest(f"--replicas must be at least 1, got {replicas}")
    if config.port == 0:
        raise InvalidRequest("--port 0 is not supported with --replicas: Ray Serve's proxy needs a fixed port")
    if replica_cpus < 0:
        raise InvalidRequest("--replica-cpus must be >= 0")
    if not connect_timeout > 0 or not start_timeout > 0:
        raise InvalidRequest("--ray-connect-timeout and --replica-start-timeout must be > 0 seconds")
    if address is None:
        cpus = os.cpu_count() or 1
        if replicas * replica_cpus > cpus:
            raise InvalidRequest(f"{replicas} replicas x {replica_cpus} CPUs exceed this machine's {cpus} CPUs; "
                                 f"lower --replica-cpus (fractions are fine) or --replicas")
        # Read by Ray when it is imported: set before the import below.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import logging

    import ray
    from ray import serve

    verbose = log_level in ("info", "debug")
    level = getattr(logging, log_level.upper())
    if address is None:
        ray.init(include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES, log_to_driver=verbose,
                 logging_level=level)
    else:
        from polyengine.remote import call_with_deadline, check_reachable

        what = "the Ray cluster (--ray-address)"
        check_reachable(address, connect_timeout, what)
        call_with_deadline(lambda: ray.init(address=address, log_to_driver=verbose, logging_level=level),
                           connect_timeout, address=address, what=what)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": config.host, "port": config.port},
                    logging_config={"log_level": log_level.upper()})
        app = deployment(config, replicas=replicas, replica_cpus=replica_cpus, loopback=address is None)
        from polyengine.remote import call_with_deadline

        # Ray Serve waits for the replicas without a bound (a cluster without room for
        # them waits forever): bounded here, long enough for a big model to load.
        call_with_deadline(lambda: serve.run(app, name=APP_NAME, route_prefix="/", blocking=False), start_timeout,
                           address=address or "the local Ray cluster", what="the Ray Serve replicas",
                           why=f"{replicas} replica(s) x {replica_cpus} CPUs may not fit the cluster, or loading the "
                               f"model takes longer: see Ray's log, raise --replica-start-timeout")
        print(f"polyengine serve: {replicas} replica(s) on Ray Serve, listening on "
              f"http://{config.host}:{config.port}", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
        print("polyengine serve: shutting down the replicas", file=sys.stderr, flush=True)
        serve.shutdown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        ray.shutdown()
    return 0
