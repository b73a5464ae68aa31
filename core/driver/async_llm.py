"""``polyengine.AsyncLLM``: the driver for asyncio.

One engine thread owns the :class:`Scheduler`: it queues submitted requests, applies
cancellations, steps, and after each step hands every request's new stream deltas to
the event loop that submitted it (one ``loop.call_soon_threadsafe`` per loop and step).
The event loop never takes the scheduler's lock, so a long prefill or ``generate``
never blocks it; the loop only tokenizes and validates (cheap) and waits.

Boundaries:
- A bad request (prompt, parameters, a feature the backend lacks) fails at ``submit``,
  before anything is queued (a constrained request's grammar compiles on a worker
  thread meanwhile, never on the event loop). ``QueueFull`` comes from the
  engine thread when it queues the request, at the next step boundary.
- ``cancel()`` and a cancelled ``await`` take effect at the next step boundary: the
  request's slots are free before the following ``generate``.
- An error from the engine's ``generate`` concerns every running request: each of them
  fails with it, and the loop goes on serving new requests.
- A backend call that raises ``SystemExit``, ``KeyboardInterrupt`` or any other
  ``BaseException`` fails the requests of that call with a ``PluginError`` naming it,
  like any other error of the backend (the scheduler converts it); the loop goes on.
- An engine that cannot go on (it raised :class:`~polyengine.errors.EngineDead`, e.g. a
  lost Ray worker) or an engine thread that dies of anything at all (a bug outside the
  backend's calls) makes the AsyncLLM *dead*: every pending request (queued, running, or still being submitted)
  fails with ``EngineDead`` naming the cause, every later ``submit`` raises it, and
  :attr:`AsyncLLM.dead` says so (the server's ``/health`` answers 503). Nothing hangs.
- The wrapped :class:`LLM` belongs to the engine thread: do not call its synchronous
  methods while the AsyncLLM runs.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import threading
import time
from collections import defaultdict, deque
from typing import Any, AsyncIterator

import numpy as np

from polyengine.driver.llm import LLM, Prompt
from polyengine.driver.outputs import Completion, StreamDelta
from polyengine.driver.scheduler import Request
from polyengine.errors import EngineClosed, EngineDead, InvalidRequest
from polyengine.sampling.params import SamplingParams

__all__ = ["AsyncLLM", "AsyncRequest"]

log = logging.getLogger("polyengine.driver")


class AsyncRequest:
    """A submitted request seen from the event loop.

    Iterate it (``async for delta in req``) to stream, or ``await req.result()`` for
    the :class:`Completion`; either raises the request's error if it failed. One
    consumer streams; ``result()`` alone discards the deltas. Timing (monotonic
    seconds, measured on the engine thread when a step's tokens are handed over):
    ``submitted_at``, ``first_token_at``, ``last_token_at`` and ``token_gaps`` (one
    entry per later step that gave this request tokens: the inter-token latency).
    """

    def __init__(self, owner: "AsyncLLM", request: Request, loop: asyncio.AbstractEventLoop):
        self._owner = owner
        self._request = request
        self._loop = loop
        self._events: deque[StreamDelta] = deque()
        self._wake = asyncio.Event()
        self._discard = False
        self._finished = False
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.token_gaps: list[float] = []
        self._callbacks: list[Any] = []

    @property
    def id(self) -> str:
        return self._request.id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._request.prompt_tokens

    @property
    def sampling(self) -> SamplingParams:
        """The request's parameters, with the seed it runs with."""
        return self._request.sampling

    @property
    def done(self) -> bool:
        """Everything about this request has reached the event loop."""
        return self._finished

    @property
    def completion(self) -> Completion | None:
        """The Completion once the request ended without error (else None)."""
        return self._completion

    @property
    def error(self) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Any) -> None:
        """Call ``fn(request)`` on the event loop when the request ends (at once if it has)."""
        if self._finished:
            fn(self)
        else:
            self._callbacks.append(fn)

    def cancel(self) -> None:
        """Stop the request (thread-safe); its slots are freed at the next step boundary."""
        if not self._finished:
            self._owner._post(("cancel", self._request))

    async def result(self) -> Completion:
        """Wait for the request to end; its Completion (``finish_reason`` may be
        ``"cancelled"``), or its error raised. Cancelling the wait cancels the request."""
        self._discard = True
        self._events.clear()
        try:
            while not self._finished:
                self._wake.clear()
                await self._wake.wait()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if self._error is not None:
            raise self._error
        assert self._completion is not None
        return self._completion

    def __aiter__(self) -> AsyncIterator[StreamDelta]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[StreamDelta]:
        try:
            while True:
                while self._events:
                    yield self._events.popleft()
                if self._finished:
                    if self._error is not None:
                        raise self._error
                    return
                self._wake.clear()
                await self._wake.wait()
        finally:  # the consumer stopped early (closed, cancelled, raised): free the slots
            if not self._finished:
                self.cancel()

    # -- called on the event loop by the engine thread ----------------------------------

    def _push(self, events: list[StreamDelta], at: float, final: tuple | None) -> None:
        if any(e.token_ids for e in events):
            if self.first_token_at is None:
                self.first_token_at = at
            else:
                self.token_gaps.append(at - self.last_token_at)
            self.last_token_at = at
        if not self._discard:
            self._events.extend(events)
        if final is not None:
            self._completion, self._error = final
            self._finished = True
            self._owner._forget(self)
            for fn in self._callbacks:
                try:
                    fn(self)
                except Exception:  # an observer's bug must not stop the delivery to others
                    log.exception("done callback of %s failed", self.id)
        self._wake.set()


def _dispatch(items: list[tuple[AsyncRequest, list[StreamDelta], tuple | None]], at: float) -> None:
    for handle, events, final in items:
        handle._push(events, at, final)


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller stopped waiting
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the submitter stopped waiting; it cancels the request itself
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class AsyncLLM:
    """Serve requests from asyncio with continuous batching on one engine thread.

    Built like :class:`LLM` (``model``, ``backend``, ``tools``, ``max_queue``,
    ``progress`` and the EngineConfig keywords), or around an existing one with
    :meth:`from_llm`. Use ``async with`` or call :meth:`shutdown` to stop the thread.
    """

    def __init__(self, model: Any = None, backend: str = "auto", **kwargs: Any):
        self._start(LLM(model, backend, **kwargs))

    @classmethod
    def from_llm(cls, llm: LLM) -> "AsyncLLM":
        """Drive ``llm``'s scheduler from a new engine thread (the AsyncLLM owns it now)."""
        self = cls.__new__(cls)
        self._start(llm)
        return self

    def _start(self, llm: LLM) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self._scheduler = llm.scheduler
        self._inbox: deque[tuple] = deque()
        self._wakeup = threading.Condition()
        self._live: dict[Request, AsyncRequest] = {}  # engine thread only
        self._failed: dict[Request, BaseException] = {}  # engine thread only
        self._handles: set[AsyncRequest] = set()  # every handle not yet finished
        self._handles_lock = threading.Lock()
        self._closed = False
        self._stopped = False
        self._dead: EngineDead | None = None
        self.num_waiting = 0  # requests queued for a slot (updated by the engine thread)
        self.num_running = 0  # requests holding slots
        self._thread = threading.Thread(target=self._run, name="polyengine-engine", daemon=True)
        self._thread.start()

    # -- the event-loop side ---------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def dead(self) -> EngineDead | None:
        """Why the engine can serve no more requests, or None while it can."""
        return self._dead

    def _refusal(self) -> Exception:
        if self._dead is not None:
            return _copy(self._dead)
        return EngineClosed("the engine has stopped and accepts no new requests")

    @property
    def prefix_cache(self) -> Any:
        """The driver's prefix cache (its ``stats`` may be read from any thread), or None when off."""
        return self._scheduler.prefix_cache

    @property
    def page_stats(self) -> dict[str, int]:
        """The K/V page pool's counts and the preemptions so far (any thread may read them)."""
        return self._scheduler.page_stats()

    @property
    def lane_prefills(self) -> int:
        """Prompt pieces prefilled on the engine's prefill lane so far (a plain read)."""
        return self._scheduler.lane_prefills

    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return self.llm.encode(prompt)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        return self.llm.apply_chat_template(messages, **kwargs)

    def tool_chat_prompt(self, messages: list[dict[str, Any]], sampling: SamplingParams, tools: Any,
                         tool_choice: Any) -> tuple[list[int], SamplingParams, list[dict[str, Any]], Any]:
        return self.llm.tool_chat_prompt(messages, sampling, tools, tool_choice)

    async def submit(self, prompt: Prompt, sampling: SamplingParams | dict | None = None, *,
                     cache_salt: str | None = None) -> AsyncRequest:
        """Validate and queue one request; return its handle once it is queued.

        Raises InvalidRequest or UnsupportedFeature at once (nothing queued), QueueFull
        when ``max_queue`` requests already wait for a slot, EngineClosed after
        :meth:`shutdown` began. Cancelling this call cancels the request. ``cache_salt``
        (as :meth:`LLM.submit`): the prefix cache partition of the request's tenant.
        """
        if self._dead is not None:
            raise _copy(self._dead)
        if self._closed:
            raise EngineClosed("the engine is shutting down and accepts no new requests")
        text, ids = self.llm.encode(prompt)
        sampling = SamplingParams.coerce(sampling)
        if sampling.structured is not None:
            # Compiling a grammar can take a large schema's whole second: on a worker thread,
            # so that the event loop (other requests' streams, /health) keeps running.
            req = await asyncio.to_thread(self._scheduler.prepare, ids, sampling, prompt=text, cache_salt=cache_salt)
        else:
            req = self._scheduler.prepare(ids, sampling, prompt=text, cache_salt=cache_salt)
        loop = asyncio.get_running_loop()
        handle = AsyncRequest(self, req, loop)
        queued = loop.create_future()
        with self._handles_lock:
            self._handles.add(handle)
        if not self._post(("submit", handle, queued)):
            self._forget(handle)
            raise self._refusal()
        try:
            await queued
        except BaseException:
            self._forget(handle)
            handle.cancel()  # harmless if it was never queued
            raise
        return handle

    async def generate(self, prompt: Prompt, sampling: SamplingParams | dict | None = None, *,
                       cache_salt: str | None = None) -> Completion:
        """Complete one prompt (raw text or token ids)."""
        return await (await self.submit(prompt, sampling, cache_salt=cache_salt)).result()

    async def stream(self, prompt: Prompt, sampling: SamplingParams | dict | None = None, *,
                     cache_salt: str | None = None) -> AsyncIterator[StreamDelta]:
        """Yield the deltas of one prompt; closing the iterator early cancels the request."""
        handle = await self.submit(prompt, sampling, cache_salt=cache_salt)
        async for delta in handle:
            yield delta

    async def chat(self, messages: list[dict[str, Any]], sampling: SamplingParams | dict | None = None, *,
                   cache_salt: str | None = None) -> Completion:
        """Answer a conversation with the model's chat template."""
        return await self.generate(self.apply_chat_template(messages), sampling, cache_salt=cache_salt)

    async def stream_chat(
        self, messages: list[dict[str, Any]], sampling: SamplingParams | dict | None = None, *,
        cache_salt: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        async for delta in self.stream(self.apply_chat_template(messages), sampling, cache_salt=cache_salt):
            yield delta

    async def embed(self, prompts: Prompt | list[Prompt], *, normalize: bool = True) -> Any:
        """One embedding per prompt, as :meth:`LLM.embed` (a ``(prompts, hidden_size)``
        float32 array). Every prompt is checked first (UnsupportedFeature,
        InvalidRequest: nothing runs); each then runs on the engine thread between
        steps, so running streams wait for it as for a prefill, one prompt at a time."""
        if self._dead is not None:
            raise _copy(self._dead)
        if self._closed:
            raise EngineClosed("the engine is shutting down and accepts no new requests")
        batch = self.llm._as_batch(prompts)
        if not batch:
            raise InvalidRequest("no prompts to embed: pass at least one", field="prompt")
        ids = []
        for i, p in enumerate(batch):
            try:
                ids.append(self._scheduler.check_embed(self.llm.encode(p)[1]))
            except InvalidRequest as exc:
                raise type(exc)(f"prompt {i}: {exc}" if len(batch) > 1 else str(exc), field=exc.field) from None
        loop = asyncio.get_running_loop()
        vectors = []
        for tokens in ids:
            done = loop.create_future()
            if not self._post(("call", functools.partial(self._scheduler.embed, tokens, normalize=normalize), done)):
                raise self._refusal()
            vectors.append(await done)
        return np.stack(vectors)

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting requests, let running ones finish for up to ``timeout``
        seconds, cancel what is left, and stop the engine thread."""
        self._closed = True
        with self._handles_lock:
            pending = [h for h in self._handles if not h.done]
        waits = [asyncio.ensure_future(_finished(h)) for h in pending]
        if waits and timeout > 0:
            await asyncio.wait(waits, timeout=timeout)
        for h in pending:
            h.cancel()
        if waits:  # cancelled requests end at the next step boundary
            _, late = await asyncio.wait(waits, timeout=5.0)
            for w in late:
                w.cancel()
        self._post(("stop",))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)

    def close(self) -> None:
        """Stop the engine thread now (from synchronous code); running requests are cancelled."""
        self._closed = True
        self._post(("stop",))
        if threading.current_thread() is not self._thread:
            self._thread.join(10.0)

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown(timeout=0)

    def _post(self, command: tuple) -> bool:
        """Hand a command to the engine thread; False once that thread has stopped."""
        with self._wakeup:
            if self._stopped:
                return False
            self._inbox.append(command)
            self._wakeup.notify()
            return True

    def _forget(self, handle: AsyncRequest) -> None:
        with self._handles_lock:
            self._handles.discard(handle)

    # -- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - whatever ends this thread, nobody may be left waiting
            dead = exc if isinstance(exc, EngineDead) else EngineDead(
                f"the engine thread stopped: {type(exc).__name__}: {exc} (backend {getattr(self.engine, 'name', '?')}); "
                f"restart the engine")
            log.error("engine is dead: %s", dead, exc_info=not isinstance(exc, EngineDead))
            self._die(dead)

    def _die(self, dead: EngineDead) -> None:
        """Fail everything pending with ``dead`` and refuse everything later."""
        with self._wakeup:
            self._dead = dead
            self._closed = self._stopped = True
            late = list(self._inbox)
            self._inbox.clear()
        for command in late:
            if command[0] == "submit":
                self._call(command[1]._loop, _settle, command[2], _copy(dead))
            elif command[0] == "call":
                self._call(command[2].get_loop(), _resolve, command[2], None, _copy(dead))
        with self._handles_lock:
            pending = [h for h in self._handles if not h.done]
        now = time.monotonic()
        for handle in pending:  # queued or running: each ends with the error, none waits forever
            self._call(handle._loop, _dispatch, [(handle, [], (None, _copy(dead)))], now)
        self._live.clear()
        self.num_waiting = self.num_running = 0

    def _serve(self) -> None:
        while True:
            with self._wakeup:
                while not self._inbox and not self._scheduler.busy:
                    self._wakeup.wait()
                commands = list(self._inbox)
                self._inbox.clear()
            stop = False
            for command in commands:
                stop = self._apply(command) or stop
            if stop:
                with self._wakeup:  # from now on _post refuses, so nothing waits on us
                    self._stopped = True
                    late = list(self._inbox)
                for command in late:
                    if command[0] == "submit":
                        self._call(command[1]._loop, _settle, command[2], EngineClosed("the engine has stopped"))
                    elif command[0] == "call":
                        self._call(command[2].get_loop(), _resolve, command[2], None, EngineClosed("the engine has stopped"))
                self._cancel_all()
                self._deliver()
                return
            if self._scheduler.busy:
                try:
                    self._scheduler.step()
                except EngineDead:
                    raise
                except Exception as exc:  # generate failed: every running request fails with it
                    log.exception("engine step failed; failing %d request(s)", len(self._live))
                    self._fail_running(exc)
            self._deliver()

    def _apply(self, command: tuple) -> bool:
        kind = command[0]
        if kind == "submit":
            _, handle, queued = command
            error: BaseException | None = None
            try:
                self._scheduler.enqueue(handle._request)
                self._live[handle._request] = handle
            except Exception as exc:  # QueueFull
                error = exc
            self._call(handle._loop, _settle, queued, error)
        elif kind == "call":  # work outside the slots (an embedding): its result or error to its waiter
            _, fn, done = command
            try:
                result, error = fn(), None
            except EngineDead as exc:
                self._call(done.get_loop(), _resolve, done, None, _copy(exc))
                raise
            except Exception as exc:
                result, error = None, exc
            self._call(done.get_loop(), _resolve, done, result, error)
        elif kind == "cancel":
            self._scheduler.cancel(command[1])
        elif kind == "stop":
            return True
        return False

    def _fail_running(self, exc: BaseException) -> None:
        for req in self._live:
            if req.status == "running":
                self._failed[req] = exc
                try:
                    self._scheduler.cancel(req)
                except Exception:  # the engine is already failing; still release the rest
                    log.exception("could not free the slots of %s", req.id)

    def _cancel_all(self) -> None:
        for req in list(self._live):
            self._scheduler.cancel(req)

    def _deliver(self) -> None:
        """Hand each request's new deltas (and its end) to its event loop."""
        now = time.monotonic()
        per_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        waiting = running = 0
        for req, handle in list(self._live.items()):
            waiting += req.status == "queued"
            running += req.status == "running"
            if not req.events and not req.done:
                continue
            events = list(req.events)
            req.events.clear()
            final = None
            if req.done:
                del self._live[req]
                error = self._failed.pop(req, None) or req.error
                final = (None if error else req.completion, error)
            per_loop[handle._loop].append((handle, events, final))
        self.num_waiting, self.num_running = waiting, running
        for loop, items in per_loop.items():
            if not self._call(loop, _dispatch, items, now):
                for handle, _, _ in items:  # nobody can listen any more
                    self._scheduler.cancel(handle._request)

    @staticmethod
    def _call(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> bool:
        try:
            loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # the loop is closed
            return False


def _copy(dead: EngineDead) -> EngineDead:
    """The error each waiter gets: of the engine's own type (a ``WorkerLost`` stays one)
    and message, a fresh object per raise (one object raised in many tasks would
    collect all their tracebacks)."""
    try:
        fresh = copy.copy(dead)
        fresh.__traceback__ = None
        return fresh
    except Exception:  # a subclass that cannot be copied: its base class says the same
        return EngineDead(str(dead))


async def _finished(handle: AsyncRequest) -> None:
    while not handle.done:
        handle._wake.clear()
        await handle._wake.wait()
