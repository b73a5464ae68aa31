"""``polyengine serve``: the OpenAI-compatible server from the command line.

:func:`add_command` is the ``polyengine.commands`` entry point (the core CLI adds it
as a sub-command); ``python -m polyengine.serving`` runs the same command. Importing
this module costs nothing: the web stack loads when the command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Sequence

from polyengine.cli_config import add_config_arg
from polyengine.cli_run import add_engine_config_args, nonnegative_number
from polyengine.errors import PolyengineError
from polyengine.limits import DEFAULT_CONTEXT_LENGTH
from polyengine.serving.config import BODY_BYTES_PER_POSITION, MIN_BODY_BYTES

__all__ = ["add_command", "configure", "main", "run"]

_DEPS = ("fastapi", "uvicorn", "prometheus_client")


def add_command(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over an OpenAI-compatible HTTP API (needs polyengine[serve]).")
    configure(p)
    p.set_defaults(func=run)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file, HF folder, Hugging Face name (ORG/NAME, ORG/NAME:Q4_K_M, ORG/NAME@REVISION; "
                        "docs/models.md), plugin model name or random:<preset> (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--backend", default="auto", help="backend name or 'auto' (see `polyengine backends`)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes the server)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port, announced on stderr)")
    p.add_argument("--api-key", dest="api_key", action="append", default=None, type=_api_key,
                   help="require 'Authorization: Bearer KEY' on /v1/ routes; repeat it for several clients (each "
                        "key is a tenant of the prefix cache) (default: $POLYENGINE_API_KEY, several separated "
                        "by commas, else none)")
    p.add_argument("--max-queue", type=int, default=128, help="requests waiting for a slot before new ones get 429")
    p.add_argument("--max-slots", type=int, default=8, help="requests decoded together (engine slots)")
    p.add_argument("--context-length", type=int, default=None,
                   help=f"prompt + completion tokens per request (default: {DEFAULT_CONTEXT_LENGTH}, or the model's "
                        f"limit if smaller)")
    p.add_argument("--dtype", default=None, help="compute dtype (backend default if omitted)")
    p.add_argument("--prefix-cache-mib", type=nonnegative_number, default=None,
                   help="memory the prefix cache may hold, MiB (default: as much as the slots' KV cache; 0: off)")
    p.add_argument("--prefix-cache-partition", choices=("key", "salt"), default="key",
                   help="who shares cached prompts: 'key' (default): requests of the same API key and cache_salt; "
                        "'salt': of the same cache_salt, whatever their key (docs/security.md)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="the longest prefill piece while other requests decode (default 64; 0: whole prompts)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prompt tokens one step prefills, over every prompt being prefilled, while other requests "
                        "decode (default 64; docs/serving.md)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: --model as given, or SmolLM2-135M-Instruct)")
    p.add_argument("--no-tools", action="store_true", help="disable the calculator tool")
    add_engine_config_args(p)
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM before they are cancelled")
    lim = p.add_argument_group("limits on clients (docs/serving.md)")
    lim.add_argument("--max-body-bytes", type=int, default=None,
                     help=f"largest request body; larger ones get 413 before they are read (default: "
                          f"{BODY_BYTES_PER_POSITION} bytes per context position, at least {MIN_BODY_BYTES // 1024**2} MiB)")
    lim.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds a connection has to send a complete request head, from opening or from its "
                          "previous response; then it is closed (default 10)")
    lim.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds a request body has to arrive completely; then 408 (default 30)")
    lim.add_argument("--idle-timeout", type=float, default=5.0,
                     help="seconds an idle keep-alive connection stays open (default 5)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    g = p.add_argument_group("replicas on Ray Serve (needs ray[serve], in polyengine[serve])")
    g.add_argument("--replicas", type=int, default=None,
                   help="run N engine replicas behind one endpoint on Ray Serve")
    g.add_argument("--ray-address", default=None,
                   help="an existing Ray cluster (e.g. ray://head:10001 or 'auto'); default: start a local one on 127.0.0.1")
    g.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each replica")
    g.add_argument("--ray-connect-timeout", type=float, default=30.0,
                   help="seconds to reach --ray-address before giving up with an error (default 30)")
    g.add_argument("--replica-start-timeout", type=float, default=600.0,
                   help="seconds for every replica to load its model and answer (default 600)")
    # --api-key keeps its own variable, several keys separated by commas, and stays out
    # of config files (docs/serving.md).
    add_config_arg(p, "serve", exclude=("api-key",))


def _api_key(text: str) -> str:
    from polyengine.serving.config import check_key

    try:
        return check_key(text, "--api-key")
    except PolyengineError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _check_deps(extra: Sequence[str] = ()) -> None:
    import importlib.util

    missing = [m for m in (*_DEPS, *extra) if importlib.util.find_spec(m) is None]
    if missing:
        raise PolyengineError(f"`polyengine serve` needs {', '.join(missing)}; fix: pip install 'polyengine[serve]'")


def run(args: argparse.Namespace) -> int:
    from polyengine.serving.config import API_KEY_ENV, LOOPBACK_HOSTS, ServerConfig, api_keys_from

    _check_deps(("ray",) if args.replicas is not None else ())
    config = ServerConfig(
        model=args.model, backend=args.backend, served_model_name=args.served_model_name, host=args.host,
        port=args.port, api_keys=api_keys_from(args.api_key, os.environ.get(API_KEY_ENV)),
        prefix_cache_partition=args.prefix_cache_partition,
        max_queue=args.max_queue, max_slots=args.max_slots, context_length=args.context_length, dtype=args.dtype,
        tools=not args.no_tools, shutdown_timeout=args.shutdown_timeout, max_body_bytes=args.max_body_bytes,
        header_timeout=args.header_timeout, body_timeout=args.body_timeout, idle_timeout=args.idle_timeout,
        prefix_cache_mib=args.prefix_cache_mib, prefill_chunk=args.prefill_chunk,
        max_num_batched_tokens=args.max_num_batched_tokens,
        options=dict(args.options), prefill_buckets=args.prefill_buckets,
    )
    from polyengine.cli_checks import check_before_loading

    # Token ids need no tokenizer: a folder without one can still be served.
    check_before_loading(config.model, backend=config.backend, options=config.options,
                         context_length=config.context_length, needs_tokenizer=False)
    if config.host not in LOOPBACK_HOSTS and not config.api_keys:
        print(f"polyengine serve: warning: binding {config.host} without --api-key: anyone who can reach "
              f"this address can use the server", file=sys.stderr)
    if args.replicas is not None:
        from polyengine.serving.replicas import run_replicas

        return run_replicas(config, replicas=args.replicas, address=args.ray_address,
                            replica_cpus=args.replica_cpus, log_level=args.log_level,
                            connect_timeout=args.ray_connect_timeout, start_timeout=args.replica_start_timeout)
    from polyengine.serving.app import build_app
    from polyengine.serving.config import build_engine
    from polyengine.serving.server import bind, serve

    sock = bind(config.host, config.port)  # fail on a taken port before loading the model
    t0 = time.monotonic()
    print(f"polyengine serve: loading {config.model or 'the default model'}...", file=sys.stderr, flush=True)
    try:
        engine, name = build_engine(config)
    except BaseException:
        sock.close()
        raise
    print(f"polyengine serve: serving {name!r} on backend {engine.engine.name} "
          f"({config.max_slots} slots, context {engine.engine.max_cache_length}, "
          f"loaded in {time.monotonic() - t0:.1f}s)", file=sys.stderr, flush=True)
    app = build_app(config, engine, name)
    try:
        return serve(app, sock, shutdown_timeout=config.shutdown_timeout, log_level=args.log_level,
                     access_log=args.access_log, header_timeout=config.header_timeout,
                     idle_timeout=config.idle_timeout, drain=engine.shutdown)
    finally:
        engine.close()  # no-op after a normal shutdown; stops the engine thread if serving failed


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m polyengine.serving``: the serve command on its own."""
    from polyengine.cli import Parser

    parser = Parser(prog="python -m polyengine.serving", description="Serve a model over an OpenAI-compatible HTTP API.")
    configure(parser)
    try:
        args = parser.parse_args(argv)
        return run(args)
    except PolyengineError as exc:
        print(f"polyengine serve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
