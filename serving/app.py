"""The OpenAI-compatible HTTP API over one :class:`~polyengine.driver.AsyncLLM` (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream as
server-sent events ending in ``data: [DONE]``), ``POST /v1/embeddings``
(embeddings.py), ``POST /tokenize`` and ``POST /detokenize`` (tokenization.py),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. With an API key, every ``/v1/``
route, ``/tokenize`` and ``/detokenize`` need ``Authorization: Bearer KEY``;
``/health`` and ``/metrics`` stay open (probes and scrapers carry no key).

Request life: read the body (bounded in size and time by :class:`_Guard`), then, on a
worker thread so that a large or slow request never stalls the event loop (``/health``
included): parse and shape-check it (protocol.py), build SamplingParams and tokenize
(the core checks values and names the field at fault), then submit every prompt and
stream or wait. A client that disconnects, streaming or not, cancels its requests at
once (their slots are free at the next engine step); one that disconnects while
sending its body is dropped without an error in the log. ``/health`` answers 503 while
the engine loads, after it died (``AsyncLLM.dead``) and while the server stops. The app
knows nothing about processes or signals: server.py runs it with uvicorn, replicas.py
on Ray Serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from polyengine._version import __version__
from polyengine.errors import PolyengineError
from polyengine.sampling.params import SamplingParams
from polyengine.serving.config import ServerConfig, build_engine, default_body_limit
from polyengine.serving.errors import APIError, from_polyengine, invalid
from polyengine.serving.metrics import CONTENT_TYPE, Metrics
from polyengine.serving.embeddings import embedding_response, parse_embedding_request
from polyengine.serving.protocol import (
    ChatRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, TokenizeRequest, chat_messages,
    check_lengths, parse_body, to_sampling,
)
from polyengine.serving.tokenization import detokenize, tokenize
from polyengine.serving.responses import Responder, TokenText, sse

__all__ = ["build_app"]

_API_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models", "/tokenize", "/detokenize")
# Routes outside /v1/ that still need the API key (vLLM's paths; they cost the server work).
_KEYED_ROOT_ROUTES = ("/tokenize", "/detokenize")
TENANT_SCOPE = "polyengine.tenant"  # the ASGI scope key _Gate sets: the digest of the request's API key


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
    app.add_middleware(_Guard, state=state)  # inner: the key is checked before any body byte is read
    app.add_middleware(_Gate, state=state)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=499)  # the client left while sending its body: nobody reads this

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
        eng = state.engine
        if eng is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        if eng.dead is not None:  # restart me: every request would fail
            return JSONResponse({"status": "dead", "error": str(eng.dead)}, status_code=503)
        if eng.closed:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok", "model": state.model_name, "backend": eng.engine.name})

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
        raw = await request.body()
        req, sampling, names, encoded = await asyncio.to_thread(state.prepare_completion, raw)
        return await state.run(request, "completion", encoded, sampling, names, req, arrived, "prompt")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        arrived = time.monotonic()
        raw = await request.body()
        req, sampling, names, encoded, tools = await asyncio.to_thread(state.prepare_chat, raw)
        return await state.run(request, "chat", encoded, sampling, names, req, arrived, "messages", tools=tools)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        raw = await request.body()
        req, prompts, count = await asyncio.to_thread(state.prepare_embeddings, raw)
        try:
            vectors = await _unless_disconnected(request, state.engine.embed(prompts, normalize=req.normalize))
        except _ClientGone:
            return Response(status_code=499)
        except Exception as exc:
            raise state.api_error(exc, {}, "input") from None
        return JSONResponse(embedding_response(vectors, model=state.model_name, prompt_tokens=count,
                                               encoding_format=req.encoding_format))

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        raw = await request.body()
        return JSONResponse(await asyncio.to_thread(state.tokenize, raw))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        raw = await request.body()
        return JSONResponse(await asyncio.to_thread(state.detokenize, raw))

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

    @property
    def body_limit(self) -> int:
        """Bytes a request body may have: ``--max-body-bytes``, else the context's default."""
        if self.config.max_body_bytes is not None:
            return self.config.max_body_bytes
        context = self.engine.engine.max_cache_length if self.engine is not None else 0
        return default_body_limit(context)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r} "
                                f"(GET /v1/models)", param="model", code="model_not_found")

    # -- preparing a request (on a worker thread: parsing and tokenizing can take long) --

    def _lengths(self, data: dict[str, Any]) -> None:
        # More prompts than the server holds at once could never all be queued: a retry
        # would not help, so that is a 400, not a 429.
        check_lengths(data, max_prompts=self.config.max_slots + self.config.max_queue,
                      max_prompt_tokens=self.engine.engine.max_prefill_length)

    def prepare_completion(self, raw: bytes) -> tuple[CompletionRequest, SamplingParams, dict[str, str], list[list[int]]]:
        req = parse_body(raw, CompletionRequest, self._lengths)
        self.check_model(req.model)
        sampling, names = to_sampling(req)
        # A list of strings or of token lists is several prompts; a flat token list is one.
        several = isinstance(req.prompt, list) and bool(req.prompt) and not isinstance(req.prompt[0], int)
        prompts = req.prompt if several else [req.prompt]
        with self.blaming(names, "prompt"):
            return req, sampling, names, [self.engine.encode(p)[1] for p in prompts]

    def prepare_chat(self, raw: bytes) -> tuple[ChatRequest, SamplingParams, dict[str, str], list[list[int]], list | None]:
        """The request, its sampling (constrained by ``tool_choice`` where it forces a
        call), the request's names for the core's fields, the prompt, and the tools whose
        calls the response parses (None: none)."""
        req = parse_body(raw, ChatRequest, self._lengths)
        self.check_model(req.model)
        sampling, names = to_sampling(req)
        tools = None
        with self.blaming(names, "messages"):  # bad tools are blamed on tools / tool_choice (their field)
            if req.tools is not None or req.tool_choice is not None:
                ids, constrained, tools, choice = self.engine.tool_chat_prompt(
                    chat_messages(req), sampling, *req.tool_arguments())
                if constrained is not sampling:
                    names["structured"] = "tools"  # a forced call's grammar is made of the tools' parameters
                sampling, tools = constrained, (tools if choice != "none" else None)
            else:
                ids = self.engine.apply_chat_template(chat_messages(req))
        return req, sampling, names, [ids], tools

    def prepare_embeddings(self, raw: bytes) -> tuple[EmbeddingRequest, list[list[int]], int]:
        """The request, its prompts as token ids, and their total length (usage)."""
        eng = self.engine.engine
        width = getattr(getattr(eng.model, "config", None), "hidden_size", None) if eng.model is not None else None
        req = parse_embedding_request(raw, max_prompt_tokens=eng.max_prefill_length, width=width)
        self.check_model(req.model)
        with self.blaming({}, "input"):
            prompts = [self.engine.encode(p)[1] for p in req.inputs()]
        return req, prompts, sum(map(len, prompts))

    def tokenize(self, raw: bytes) -> dict[str, Any]:
        req = parse_body(raw, TokenizeRequest, self._lengths)
        if req.model is not None:
            self.check_model(req.model)
        with self.blaming({}, "messages" if req.messages is not None else "prompt"):
            return tokenize(req, self.engine.llm, max_model_len=self.engine.engine.max_cache_length)

    def detokenize(self, raw: bytes) -> dict[str, Any]:
        req = parse_body(raw, DetokenizeRequest)
        if req.model is not None:
            self.check_model(req.model)
        with self.blaming({}, "tokens"):
            return detokenize(req, self.engine.llm)

    @contextlib.contextmanager
    def blaming(self, names: dict[str, str], what: str) -> Iterator[None]:
        try:
            yield
        except PolyengineError as exc:
            raise self.api_error(exc, names, what) from None

    def check_context(self, ids: list[int], sp: SamplingParams, names: dict[str, str], what: str) -> None:
        """The one check the server makes itself, a policy rather than a limit: a prompt
        plus ``max_tokens`` over the context is refused (as OpenAI and vLLM do), where the
        Python API would stop the completion at the cache limit. Everything else is the
        core's to refuse, naming the field."""
        eng = self.engine.engine
        ctx, n = eng.max_cache_length, len(ids)
        if sp.max_tokens is not None and n <= eng.max_prefill_length and n + sp.max_tokens > ctx:
            mt = names["max_tokens"]
            raise invalid(f"this model's maximum context length is {ctx} tokens; you requested {n + sp.max_tokens} "
                          f"({n} in the {what}, {sp.max_tokens} for the completion): reduce {mt} or the {what}",
                          mt, code="context_length_exceeded")

    def partition(self, tenant: str | None, salt: str | None) -> str | None:
        """The prefix cache partition of a request (docs/security.md, "Prefix cache and
        tenants"): its API key's and its ``cache_salt``'s (``--prefix-cache-partition key``)
        or its salt's alone (``salt``); None (the common one) for neither. The ``user``
        field does not partition: it names an end user for abuse tracking, unauthenticated,
        and per-user partitions would lose a shared system prompt's reuse."""
        if self.config.prefix_cache_partition != "key":
            tenant = None
        if tenant is None and salt is None:
            return None
        # A digest of both parts: no salt a client chooses can name another key's partition.
        return hashlib.sha256(f"{tenant or ''}\0{'' if salt is None else 's:' + salt}".encode()).hexdigest()

    def api_error(self, exc: BaseException, names: dict[str, str], what: str | None = None) -> APIError:
        """The response for a driver error: the field the core blamed, under the name the
        request used for it; the prompt (or a refusal naming no field) is ``what``."""

        def param_of(field: str | None) -> str | None:
            if field is None or field in ("prompt", "messages"):
                return what
            return names.get(field, field)

        return from_polyengine(exc, param_of=param_of)

    async def run(self, request: Request, kind: str, prompts: list[list[int]], sp: SamplingParams,
                  names: dict[str, str], req: Any, arrived: float, what: str, tools: list | None = None) -> Response:
        for ids in prompts:
            self.check_context(ids, sp, names, what)
        partition = self.partition(request.scope.get(TENANT_SCOPE), req.cache_salt)
        handles: list[Any] = []
        try:
            for ids in prompts:
                handle = await self.engine.submit(ids, sp, cache_salt=partition)
                self.metrics.track(handle, arrived)
                handles.append(handle)
        except BaseException as exc:
            for h in handles:
                h.cancel()
            if isinstance(exc, Exception):
                raise self.api_error(exc, names, what) from None
            raise
        responder = Responder(kind, self.model_name, self.token_text, self.fingerprint, tools=tools,
                              parallel=getattr(req, "parallel_tool_calls", None) is not False)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._events(handles, responder, sp, names, include_usage, what)
            return EventStream(events)
        try:
            done = await _unless_disconnected(request, _results(handles))
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; the status is for the logs and metrics
        except Exception as exc:
            raise self.api_error(exc, names, what) from None
        if any(o.finish_reason == "cancelled" for c in done for o in c.outputs):
            raise from_polyengine(_closed(), param_of=lambda f: f)
        return JSONResponse(responder.full(done))

    async def _events(self, handles: list[Any], r: Responder, sp: SamplingParams, names: dict[str, str],
                      include_usage: bool, what: str) -> AsyncIterator[bytes]:
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
            yield sse(self.api_error(exc, names, what).body())
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
    """ASGI middleware: the API key on ``/v1/`` routes, the request counter, and the
    replica's id on every ``/v1/`` response (errors and 429s included)."""

    def __init__(self, app: Any, state: _State):
        self.app = app
        self.state = state
        # Each key's tenant: a digest, so the key itself is not what the cache partitions carry.
        self._expected = [(f"Bearer {key}".encode(), hashlib.sha256(key.encode()).hexdigest()[:32])
                          for key in state.config.api_keys]
        replica = state.replica_id
        self._replica = [(b"x-polyengine-replica", replica.encode())] if replica else []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path.startswith("/v1/") or path in _KEYED_ROOT_ROUTES):
            return await self.app(scope, receive, send)
        endpoint = path if path in _API_ROUTES else "other"
        counter = self.state.metrics.requests
        started = False

        async def counting_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                counter.labels(endpoint, str(message["status"])).inc()
                if self._replica:
                    message = {**message, "headers": [*message.get("headers", []), *self._replica]}
            await send(message)

        if self._expected:
            given = dict(scope.get("headers") or []).get(b"authorization")
            tenant = None
            for expected, who in self._expected:  # every key compared, in constant time: which one matched does not show
                if given is not None and hmac.compare_digest(given, expected):
                    tenant = who
            scope[TENANT_SCOPE] = tenant
            if tenant is None:
                msg = ("missing API key: send it as 'Authorization: Bearer KEY'" if given is None
                       else "incorrect API key provided")
                err = APIError(401, msg, code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, counting_send)
                return
        await self.app(scope, receive, counting_send)


class _Guard:
    """ASGI middleware: the request body's bounds, enforced while it is read.

    A Content-Length over ``max_body_bytes`` is answered 413 before one byte of the
    body is read; a body without one (chunked) is counted as it arrives and refused as
    soon as it passes the bound, so a huge body costs at most the bound in memory. The
    whole body must arrive within ``body_timeout`` seconds (else 408): a client that
    sends a few bytes a minute cannot hold a request open. Both answers close the
    connection, since the rest of the body is never read.
    """

    def __init__(self, app: Any, state: "_State"):
        self.app = app
        self.state = state
        self.timeout = state.config.body_timeout

    @staticmethod
    def _too_large(size: str, limit: int) -> APIError:
        return APIError(413, f"the request body is {size} bytes; this server accepts at most {limit:,} "
                             f"(--max-body-bytes)", code="request_too_large", headers={"Connection": "close"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.state.body_limit
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            err = self._too_large(f"{int(declared):,}", limit)
            return await JSONResponse(err.body(), status_code=err.status, headers=err.headers)(scope, receive, send)
        deadline = time.monotonic() + self.timeout
        read, complete = 0, False

        async def guarded() -> Any:
            nonlocal read, complete
            if complete:  # later receives only watch for a disconnect: no bound
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.timeout:g} s (--body-timeout)",
                               code="request_timeout", headers={"Connection": "close"}) from None
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > limit:
                    raise self._too_large(f"over {limit:,}", limit)
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        await self.app(scope, guarded, send)
