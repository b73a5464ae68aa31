"""``polyengine.serving``: an OpenAI-compatible HTTP server over
:class:`polyengine.AsyncLLM`, standalone (uvicorn) or as replicas on Ray Serve.

Outside the core on purpose: it needs the ``serve`` extra (fastapi, uvicorn,
prometheus_client, ray[serve]), and the core imports none of them. Modules:
``cli`` (the command), ``config`` (what a server is started with), ``app`` (the
routes), ``protocol`` (request bodies), ``responses`` (response bodies),
``errors`` (OpenAI error bodies), ``metrics`` (Prometheus), ``server`` (uvicorn),
``replicas`` (Ray Serve). Importing this package imports none of the web stack.
"""

__all__ = ["ServerConfig", "build_app"]


def __getattr__(name: str):
    if name == "ServerConfig":
        from polyengine.serving.config import ServerConfig

        return ServerConfig
    if name == "build_app":
        from polyengine.serving.app import build_app

        return build_app
    raise AttributeError(f"module 'polyengine.serving' has no attribute {name!r}")
