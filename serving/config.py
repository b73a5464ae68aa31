"""What a server is started with, and how its engine is built from it.

A :class:`ServerConfig` is plain data: the standalone server builds its engine from it
before binding the port, and each Ray Serve replica builds its own from the same
config (it travels to the replicas, so it holds no engine and no open resources).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyengine.errors import InvalidRequest

__all__ = ["ServerConfig", "build_engine", "LOOPBACK_HOSTS", "default_body_limit", "MIN_BODY_BYTES",
           "BODY_BYTES_PER_POSITION", "PARTITIONS", "api_keys_from", "check_key"]

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})

# How the prefix cache is divided between tenants (docs/security.md, "Prefix cache and
# tenants"): "key": one partition per API key and cache_salt (a client shares cached
# prompts only with requests of its own key and salt); "salt": by cache_salt alone (keys
# of one application may share; requests without a salt share one partition).
PARTITIONS = ("key", "salt")
API_KEY_ENV = "POLYENGINE_API_KEY"


def check_key(key: object, where: str) -> str:
    """An API key as HTTP carries it: visible ASCII, no whitespace (a header value's
    leading and trailing blanks are stripped in transit, so a key with a trailing space
    could never be sent back; the key itself is never echoed)."""
    if not isinstance(key, str) or not key:
        raise InvalidRequest(f"{where}: an API key must be a non-empty string", field="api_key")
    bad = [c for c in key if not 0x21 <= ord(c) <= 0x7E]
    if bad:
        kind = "whitespace" if any(c.isspace() for c in bad) else "a character outside visible ASCII"
        at = "at its end" if key[-1] in bad else "at its start" if key[0] in bad else "inside it"
        raise InvalidRequest(f"{where}: the API key has {kind} {at} (character {ord(bad[0]):#04x}); a key must be "
                             f"visible ASCII without spaces: remove it", field="api_key")
    return key


def api_keys_from(flags: list[str] | None, env: str | None) -> tuple[str, ...]:
    """The keys ``--api-key`` (repeatable) gives, else ``$POLYENGINE_API_KEY`` (several
    separated by commas); each checked by :func:`check_key`."""
    if flags:
        return tuple(check_key(k, f"--api-key #{i + 1}") for i, k in enumerate(flags))
    if env:
        return tuple(check_key(k, f"${API_KEY_ENV} key #{i + 1}") for i, k in enumerate(env.split(",")))
    return ()

# The default body bound follows the context: a prompt the engine can take is at most
# PROMPT_CHARS_PER_TOKEN (32) characters a position, up to 4 bytes each in UTF-8 JSON;
# never below 1 MiB (a 2048-position context needs a few hundred KiB at most).
BODY_BYTES_PER_POSITION = 128
MIN_BODY_BYTES = 1024**2


def default_body_limit(context_length: int) -> int:
    """``--max-body-bytes`` when the operator did not set it."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_POSITION * context_length)


@dataclass(frozen=True)
class ServerConfig:
    """``context_length`` is prompt + completion per request (the engine's
    ``max_cache_length``; None: the engine's default, decided in one place,
    :func:`polyengine.create_engine`), ``max_slots`` the requests decoded together,
    ``max_queue`` the requests waiting for a slot before new ones get 429.
    ``shutdown_timeout`` bounds how long in-flight requests may run after SIGTERM.

    Connection limits (docs/serving.md): a request body over ``max_body_bytes`` (None:
    :func:`default_body_limit` of the context length) gets 413 (refused from its
    Content-Length, or as soon as the bytes read pass it); a
    connection that has not sent a complete request head within ``header_timeout``
    seconds of opening (or of its previous response) is closed; a body that has not
    arrived within ``body_timeout`` seconds gets 408; an idle keep-alive connection is
    closed after ``idle_timeout`` seconds. ``api_keys``: every key a client may send (none:
    no key needed); ``prefix_cache_partition``: one of :data:`PARTITIONS`. ``prefix_cache_mib`` and ``prefill_chunk``
    are the driver's (``EngineConfig.prefix_cache_bytes`` in MiB,
    ``EngineConfig.prefill_chunk``; None: their defaults, 0: off), and so is
    ``max_num_batched_tokens`` (prompt tokens per step while requests decode; None: its
    default); ``options`` and
    ``prefill_buckets`` go to ``EngineConfig`` as given (``--option``, ``--prefill-buckets``)."""

    model: str | None = None
    backend: str = "auto"
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    prefix_cache_partition: str = "key"
    max_queue: int = 128
    max_slots: int = 8
    context_length: int | None = None
    dtype: str | None = None
    tools: bool = True
    shutdown_timeout: float = 30.0
    max_body_bytes: int | None = None
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    idle_timeout: float = 5.0
    prefix_cache_mib: float | None = None
    prefill_chunk: int | None = None
    max_num_batched_tokens: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    prefill_buckets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.api_keys, str) or not isinstance(self.api_keys, (tuple, list)):
            raise InvalidRequest("api_keys must be a tuple of strings", field="api_keys")
        object.__setattr__(self, "api_keys", tuple(check_key(k, f"API key #{i + 1}")
                                                   for i, k in enumerate(self.api_keys)))
        if self.prefix_cache_partition not in PARTITIONS:
            raise InvalidRequest(f"--prefix-cache-partition must be one of {', '.join(PARTITIONS)}, "
                                 f"got {self.prefix_cache_partition!r}", field="prefix_cache_partition")
        for name in ("max_queue", "max_slots", "max_body_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidRequest(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}",
                                     field=name)
        for name in ("header_timeout", "body_timeout", "idle_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidRequest(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}",
                                     field=name)
        if self.context_length is not None and self.context_length < 2:
            raise InvalidRequest("--context-length must be at least 2")
        if self.prefix_cache_mib is not None and not 0 <= self.prefix_cache_mib < 2**44:
            raise InvalidRequest(f"--prefix-cache-mib must be a number of MiB >= 0 (0 turns the prefix cache off), "
                                 f"got {self.prefix_cache_mib}", field="prefix_cache_mib")
        if self.prefill_chunk is not None and self.prefill_chunk < 0:
            raise InvalidRequest("--prefill-chunk must be >= 0 (0 prefills whole prompts at once)")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise InvalidRequest("--max-num-batched-tokens must be >= 1 (prompt tokens one step prefills while "
                                 "requests decode)", field="max_num_batched_tokens")
        if self.shutdown_timeout < 0:
            raise InvalidRequest("--shutdown-timeout must be >= 0 seconds")
        if not 0 <= self.port < 65536:
            raise InvalidRequest(f"--port must be in [0, 65535], got {self.port}")


def served_name(config: ServerConfig, model: Any) -> str:
    """The model id clients send: ``--served-model-name``, else ``--model`` as given,
    else the default model's file name up to its first dot (``SmolLM2-135M-Instruct``)."""
    if config.served_model_name:
        return config.served_model_name
    if config.model:
        return config.model
    return Path(model.source).name.split(".")[0]


def build_engine(config: ServerConfig, progress: Any = None) -> tuple[Any, str]:
    """Load the model and start an AsyncLLM for it; returns ``(engine, served name)``."""
    from polyengine.driver import LLM, AsyncLLM
    from polyengine.models import load_model
    from polyengine.plugins import select_backend

    select_backend(config.backend)  # an unknown or unavailable backend is reported before loading weights
    model = load_model(config.model, progress=progress)
    # Only what the operator set: every default (the context length above all) is the engine's.
    extra: dict[str, Any] = {}
    if config.prefix_cache_mib is not None:
        extra["prefix_cache_bytes"] = int(config.prefix_cache_mib * 2**20)
    if config.prefill_chunk is not None:
        extra["prefill_chunk"] = config.prefill_chunk
    if config.max_num_batched_tokens is not None:
        extra["max_num_batched_tokens"] = config.max_num_batched_tokens
    if config.options:
        extra["options"] = dict(config.options)
    if config.prefill_buckets is not None:
        extra["prefill_buckets"] = tuple(config.prefill_buckets)
    llm = LLM(model, config.backend, tools=config.tools, max_queue=config.max_queue, max_slots=config.max_slots,
              max_cache_length=config.context_length, dtype=config.dtype or None, **extra)
    return AsyncLLM.from_llm(llm), served_name(config, model)
