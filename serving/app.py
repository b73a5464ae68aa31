"""The OpenAI-compatible HTTP API over one :class:`~polyengine.driver.AsyncLLM` (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream as
server-sent events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``,
``GET /metrics``. With an API key, every ``/v1/`` route needs
``Authorization: Bearer KEY``; ``/health`` and ``/metrics`` stay open (probes and
scrapers carry no key).

Request life: parse and shape-check the body (protocol.py), build SamplingParams (the
core checks values), check the context limits, submit every prompt, then stream or
wait. A client that disconnects, streaming or not, cancels its requests at once (their
slots are free at the next engine step). The app knows nothing about processes or
signals: server.py runs it with uvicorn, replicas.py on Ray Serve.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from polyengine._version import __version__
from polyengine.errors import InvalidRequest, UnsupportedFeature
from polyengine.sampling.params import ENGINE_FIELDS, SamplingParams
from polyengine.serving.config import ServerConfig, build_engine
from polyengine.serving.errors import APIError, from_polyengine, invalid
from polyengine.serving.metrics import CONTENT_TYPE, Metrics
from polyengine.serving.protocol import ChatRequest, CompletionRequest, chat_messages, parse_body, to_sampling
from polyengine.serving.responses import Responder, TokenText, sse

__all__ = ["build_app"]

_API_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models")


def build_app(config: ServerConfig, engine: Any = None, model_name: str | None = None,
              *, replica_id: str | None = None) -> FastAPI:
    """The app for ``config``. Pass a running AsyncLLM (and its served model name), or
    let the app build one at startup (what each Ray Serve replica does). The app shuts
    its engine down when it stops."""
    state = _State(config, replica_id)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine is None:
            state.attach(*await asyncio.to_thread(build_engine, config))
        else:
            state.attach(engine, model_name)
        yield
        # The HTTP server has already waited (bounded) for in-flight requests and
        # cancelled the rest; what remains is cancelled now.
        await state.engine.shutdown(timeout=0)

    app = FastAPI(title="polyengine", version=__version__, lifespan=lifespan)
    app.state.polyengine = state
    app.add_middleware(_Gate, state=state)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                       code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.engine is None or state.engine.closed:
            status = "loading" if state.engine is None else "shutting down"
            return JSONResponse({"status": status}, status_code=503)
        return JSONResponse({"status": "ok", "model": state.model_name, "backend": state.engine.engine.name})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        eng = state.engine.engine
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.started, "owned_by": "polyengine",
            "max_model_len": eng.max_cache_length,
        }]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrived = time.monotonic()
        req = parse_body(await request.body(), CompletionRequest)
        state.check_model(req.model)
        sampling, names = to_sampling(req)
        # A list of strings or of token lists is several prompts; a flat token list is one.
        several = isinstance(req.prompt, list) and bool(req.prompt) and not isinstance(req.prompt[0], int)
        prompts = req.prompt if several else [req.prompt]
        encoded = []
        for p in prompts:
            try:
                encoded.append(state.engine.encode(p)[1])
            except InvalidRequest as exc:
                raise invalid(str(exc), "prompt") from None
        return await state.run(request, "completion", encoded, sampling, names, req, arrived, "prompt")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        arrived = time.monotonic()
        req = parse_body(await request.body(), ChatRequest)
        state.check_model(req.model)
        sampling, names = to_sampling(req)
        tools = None
        try:
            if req.tools is not None or req.tool_choice is not None:
                ids, constrained, tools, choice = state.engine.tool_chat_prompt(
                    chat_messages(req), sampling, req.tools, req.tool_choice)
                if constrained is not sampling:
                    names = {**names, "structured": "tool_choice"}
                sampling, tools = constrained, (tools if choice != "none" else None)
            else:
                ids = state.engine.apply_chat_template(chat_messages(req))
        except InvalidRequest as exc:  # bad tools, or the template refused the conversation
            raise invalid(str(exc), exc.field if exc.field in ("tools", "tool_choice") else "messages") from None
        return await state.run(request, "chat", [ids], sampling, names, req, arrived, "messages", tools=tools)

    return app


class _State:
    """What the routes share: the engine, the served name, metrics, the key."""

    def __init__(self, config: ServerConfig, replica_id: str | None):
        self.config = config
        self.replica_id = replica_id
        self.engine: Any = None
        self.model_name = ""
        self.metrics = Metrics()
        self.started = int(time.time())
        self.token_text: TokenText | None = None
        self.fingerprint = ""

    def attach(self, engine: Any, model_name: str | None) -> None:
        self.engine = engine
        self.model_name = model_name or "default"
        self.token_text = TokenText(engine.tokenizer)
        self.fingerprint = f"polyengine-{__version__}-{engine.engine.name}"
        self.metrics.watch(engine)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r} "
                                f"(GET /v1/models)", param="model", code="model_not_found")

    def check_limits(self, ids: list[int], sp: SamplingParams, names: dict[str, str], what: str) -> None:
        """What the driver would refuse without naming the parameter, refused here with it."""
        eng = self.engine.engine
        ctx, n = eng.max_cache_length, len(ids)
        if n == 0:
            raise invalid(f"{what} is empty: send at least one token", what)
        if n > eng.max_prefill_length:
            raise invalid(f"this model's maximum context length is {ctx} tokens and a prompt may have at most "
                          f"{eng.max_prefill_length}; your {what} has {n} tokens: shorten it", what,
                          code="context_length_exceeded")
        if sp.max_tokens is not None and n + sp.max_tokens > ctx:
            mt = names["max_tokens"]
            raise invalid(f"this model's maximum context length is {ctx} tokens; you requested {n + sp.max_tokens} "
                          f"({n} in the {what}, {sp.max_tokens} for the completion): reduce {mt} or the {what}",
                          mt, code="context_length_exceeded")
        if sp.n > eng.max_concurrent_decodes:
            raise invalid(f"n={sp.n} samples need {sp.n} slots but the server has {eng.max_concurrent_decodes} "
                          f"(--max-slots)", names["n"])
        if sp.stop and self.engine.tokenizer is None:
            raise invalid("stop strings need a tokenizer and this model has none: use stop_token_ids", names["stop"])
        for field in ("logit_bias", "stop_token_ids"):
            bad = [t for t in getattr(sp, field) if t >= eng.vocab_size]
            if bad:
                raise invalid(f"{field}: token id {bad[0]} is outside the vocabulary [0, {eng.vocab_size})", field)

    def api_error(self, exc: Exception, sp: SamplingParams, names: dict[str, str], what: str | None = None) -> APIError:
        """The response for a driver error; ``what`` takes the blame for an InvalidRequest
        that names no field (the driver's prompt checks: token ids, emptiness)."""
        caps = self.engine.engine.capabilities
        unsupported = None
        if isinstance(exc, UnsupportedFeature):
            missing = sorted((sp.active_fields() & ENGINE_FIELDS) - caps.sampling_params)
            if missing:
                unsupported = missing[0]
            elif sp.top_logprobs > caps.max_top_logprobs:
                unsupported = "top_logprobs"
            elif sp.n > 1 and not caps.bulk_insert:
                unsupported = "n"
        return from_polyengine(exc, param_of=lambda f: names.get(f, f) if f else what, unsupported_param=unsupported)

    async def run(self, request: Request, kind: str, prompts: list[list[int]], sp: SamplingParams,
                  names: dict[str, str], req: Any, arrived: float, what: str, tools: list | None = None) -> Response:
        for ids in prompts:
            self.check_limits(ids, sp, names, what)
        handles: list[Any] = []
        try:
            for ids in prompts:
                handle = await self.engine.submit(ids, sp)
                self.metrics.track(handle, arrived)
                handles.append(handle)
        except BaseException as exc:
            for h in handles:
                h.cancel()
            if isinstance(exc, Exception):
                raise self.api_error(exc, sp, names, what) from None
            raise
        responder = Responder(kind, self.model_name, self.token_text, self.fingerprint, tools=tools)
        headers = {"x-polyengine-replica": self.replica_id} if self.replica_id else None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._events(handles, responder, sp, names, include_usage)
            return EventStream(events, headers=headers)
        try:
            done = await _unless_disconnected(request, _results(handles))
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; the status is for the logs and metrics
        except Exception as exc:
            raise self.api_error(exc, sp, names) from None
        if any(o.finish_reason == "cancelled" for c in done for o in c.outputs):
            raise from_polyengine(_closed(), param_of=lambda f: f)
        return JSONResponse(responder.full(done), headers=headers)

    async def _events(self, handles: list[Any], r: Responder, sp: SamplingParams, names: dict[str, str],
                      include_usage: bool) -> AsyncIterator[bytes]:
        n = sp.n
        merged = _merge(handles)
        offsets = [0] * (len(handles) * n)
        try:
            if r.kind == "chat":
                for i in range(len(handles) * n):
                    yield sse(r.chunk(i, "", None, role=True))
            async for p, d in merged:
                if d.finish_reason == "cancelled":  # the server is shutting down
                    yield sse(from_polyengine(_closed(), param_of=lambda f: f).body())
                    break
                idx = p * n + d.index
                lps = r.logprobs(d.token_ids, d.logprobs, d.top_logprobs, offsets[idx])
                offsets[idx] += sum(len(r.text_of(t)[0]) for t in d.token_ids)
                for chunk in r.stream_chunks(idx, d.text, d.finish_reason, lps):
                    yield sse(chunk)
            else:
                if include_usage:
                    yield sse(r.usage_chunk([h.completion for h in handles]))
        except Exception as exc:  # the 200 is sent already: report the failure in-band
            yield sse(self.api_error(exc, sp, names).body())
        finally:
            await merged.aclose()
            for h in handles:
                h.cancel()
        yield sse("[DONE]")


def _closed() -> Exception:
    from polyengine.errors import EngineClosed

    return EngineClosed("the server is shutting down")


async def _results(handles: list[Any]) -> list[Any]:
    try:
        return [await h.result() for h in handles]
    finally:  # one failed or the wait was cancelled: the others stop too
        for h in handles:
            h.cancel()


async def _merge(handles: list[Any]) -> AsyncIterator[tuple[int, Any]]:
    """``(prompt index, delta)`` from several requests as they arrive."""
    if len(handles) == 1:
        async for d in handles[0]:
            yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, h: Any) -> None:
        try:
            async for d in h:
                queue.put_nowait((p, d, None))
            queue.put_nowait((p, None, None))
        except Exception as exc:
            queue.put_nowait((p, None, exc))

    tasks = [asyncio.ensure_future(pump(p, h)) for p, h in enumerate(handles)]
    try:
        left = len(tasks)
        while left:
            p, d, exc = await queue.get()
            if exc is not None:
                raise exc
            if d is None:
                left -= 1
                continue
            yield p, d
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _ClientGone(Exception):
    pass


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Await ``work``; if the client disconnects first, cancel it and raise _ClientGone."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        gone.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        raise _ClientGone()
    return task.result()


class EventStream(Response):
    """A server-sent-event response that stops as soon as the client disconnects, also
    while no event is due (a request still waiting for a slot): its generator is closed,
    which cancels the requests behind it."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None):
        # No super().__init__: it would set a body and so a Content-Length of 0.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", **(headers or {})})
        self.events = events

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def write() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        writer = asyncio.ensure_future(write())
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            writer.cancel()
            watcher.cancel()
            await asyncio.gather(writer, watcher, return_exceptions=True)
            await self.events.aclose()
        if not writer.cancelled() and writer.exception() is not None and not isinstance(writer.exception(), OSError):
            raise writer.exception()


class _Gate:
    """ASGI middleware: the API key on ``/v1/`` routes, and the request counter."""

    def __init__(self, app: Any, state: _State):
        self.app = app
        self.state = state
        key = state.config.api_key
        self._expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            return await self.app(scope, receive, send)
        endpoint = path if path in _API_ROUTES else "other"
        counter = self.state.metrics.requests
        started = False

        async def counting_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                counter.labels(endpoint, str(message["status"])).inc()
            await send(message)

        if self._expected is not None:
            import hmac

            given = dict(scope.get("headers") or []).get(b"authorization")
            if given is None or not hmac.compare_digest(given, self._expected):
                msg = ("missing API key: send it as 'Authorization: Bearer KEY'" if given is None
                       else "incorrect API key provided")
                err = APIError(401, msg, code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, counting_send)
                return
        await self.app(scope, receive, counting_send)
