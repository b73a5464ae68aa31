"""Building an engine: pick the backend, load the model, fit the limits, call the
backend's factory, check that what came back speaks the protocol, and say (log, INFO)
what it runs on."""

from __future__ import annotations

import logging
from typing import Any

from polyengine.errors import InvalidRequest, PluginError, PolyengineError
from polyengine.memory import as_insufficient
from polyengine.selection import select_backend

__all__ = ["create_engine", "engine_config", "speed_paths", "describe_engine"]

log = logging.getLogger("polyengine")


def speed_paths(engine: Any) -> dict[str, str]:
    """What ``engine`` runs on: its optional ``speed_paths()`` (path -> words; a fallback
    says its reason and fix), else its ``device``. Never raises: it is a report."""
    paths: dict[str, str] = {}
    method = getattr(engine, "speed_paths", None)
    if callable(method):
        try:
            paths = {str(k): str(v) for k, v in method().items()}
        except Exception as exc:  # noqa: BLE001 - a report must not fail the engine
            paths = {"speed_paths": f"failed: {type(exc).__name__}: {exc}"}
    if "device" not in paths and getattr(engine, "device", None):
        paths = {"device": str(engine.device), **paths}
    return paths


def describe_engine(engine: Any) -> str:
    """One line for a log: ``name: path: words; path: words``."""
    return f"{getattr(engine, 'name', type(engine).__name__)}: " + "; ".join(
        f"{k}: {v}" for k, v in speed_paths(engine).items())


def engine_config(values: dict[str, Any]):
    """An :class:`EngineConfig` from a dict, with pydantic's errors as InvalidRequest."""
    from pydantic import ValidationError

    from polyengine.engine import EngineConfig

    try:
        return EngineConfig(**values)
    except ValidationError as exc:
        errors = exc.errors()
        msgs = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in errors)
        loc = errors[0]["loc"]
        raise InvalidRequest(f"invalid engine config: {msgs}", field=str(loc[0]) if loc else None) from None


def create_engine(backend: str = "auto", model: Any = None, config: Any = None, **config_kwargs: Any):
    """Build an engine: pick the backend, load the model, call the backend's factory.

    ``model`` is anything :func:`polyengine.models.load_model` takes (None: the
    embedded default) or an already loaded :class:`polyengine.models.Model`.
    ``config`` is an :class:`EngineConfig` or a dict; keyword arguments override it.
    Limits left unset are fitted to the model, here and nowhere else (the command line
    and the server pass only what their user set): ``max_cache_length`` defaults to
    ``min(DEFAULT_CONTEXT_LENGTH, max_position_embeddings)`` and ``max_prefill_length``
    to ``max_cache_length - 1``. A value of None counts as unset.
    """
    from polyengine.engine import DEFAULT_CONTEXT_LENGTH, EngineConfig, protocol_problems
    from polyengine.models import Model

    info = select_backend(backend)
    if isinstance(config, EngineConfig):
        values, explicit = config.model_dump(), set(config.model_fields_set)
    else:
        values = dict(config or {})
        explicit = set(values)
    values.update(config_kwargs)
    explicit |= set(config_kwargs)
    explicit -= {k for k, v in values.items() if v is None}  # None: "not chosen", as --context-length leaves it

    def fitted(positions: int | None = None) -> EngineConfig:
        v = {k: val for k, val in values.items() if val is not None}
        if "max_cache_length" not in explicit:
            v["max_cache_length"] = min(DEFAULT_CONTEXT_LENGTH, positions or 1 << 62)
        if "max_prefill_length" not in explicit:
            v.pop("max_prefill_length", None)  # EngineConfig derives it from max_cache_length
        return engine_config(v)

    fitted()  # refuse a bad config before loading weights
    factory = info.load_factory()
    if isinstance(model, Model):
        loaded = model
    else:
        from polyengine.models import load_model

        loaded = load_model(model, exclusive=True)  # for this engine alone (Model.exclusive)
    try:
        engine = factory(model=loaded, config=fitted(loaded.config.max_position_embeddings))
    except PolyengineError:
        raise
    except MemoryError as exc:  # the engine's own allocation failed: a memory problem, not a bug
        raise as_insufficient(exc, f"building the {info.name!r} backend's engine") from exc
    except SystemExit as exc:  # a library must not end the caller's process
        raise PluginError(
            info.plugin, info.distribution,
            f"factory of backend {info.name!r} called sys.exit({exc.code!r})",
        ) from None
    except Exception as exc:  # a backend's bug or an untyped device error: say whose
        raise PluginError(
            info.plugin, info.distribution,
            f"factory of backend {info.name!r} raised {type(exc).__name__}: {exc}",
        ) from exc
    problems = protocol_problems(engine)
    if problems:
        raise PluginError(
            info.plugin, info.distribution,
            f"factory of backend {info.name!r} returned a {type(engine).__name__} that does not implement the "
            f"engine protocol: " + "; ".join(problems),
        )
    # The paths ride along so that the command line can print them one per line (-v).
    log.info("backend %s", describe_engine(engine), extra={"engine_name": info.name, "speed_paths": speed_paths(engine)})
    return engine
