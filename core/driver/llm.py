"""``polyengine.LLM``: the public, synchronous API over the scheduler.

The driver knows text and requests; the engine knows tokens and slots. Prompts are
strings (encoded with the model's tokenizer, BOS as the tokenizer adds it) or lists of
token ids. ``chat`` renders the model's own chat template first.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import numpy as np

from polyengine.driver.outputs import Completion, StreamDelta
from polyengine.driver.scheduler import Request, Scheduler, token_ids
from polyengine.errors import ContextLengthExceeded, InvalidRequest
from polyengine.limits import PROMPT_CHARS_PER_TOKEN
from polyengine.sampling.params import SamplingParams

__all__ = ["LLM"]

Prompt = str | Sequence[int]


class LLM:
    """Load a model, build an engine, and serve requests with continuous batching.

    ``model``: None (the embedded default, SmolLM2-135M-Instruct), a GGUF file, an HF
    folder, a plugin-registered name, a Hugging Face name (``ORG/NAME``,
    ``ORG/NAME:Q4_K_M``, ``ORG/NAME@REVISION``; docs/models.md), ``random:<preset>``, or
    a loaded Model.
    ``backend``: a backend name or ``"auto"``. Remaining keyword arguments build the
    EngineConfig (``max_slots``, ``max_prefill_length``, ``max_cache_length``,
    ``dtype``, ``prefill_buckets``, ``options``). ``tools``: True for every registered
    tool the tokenizer can express, False for none, or a list of Tool objects.
    ``max_queue`` bounds the requests waiting for a slot (beyond it: QueueFull).
    """

    def __init__(
        self,
        model: Any = None,
        backend: str = "auto",
        *,
        tools: Any = True,
        max_queue: int = 1024,
        progress: Any = None,
        **engine_config: Any,
    ):
        from polyengine.models import Model, load_model
        from polyengine.construction import create_engine

        # Loaded here for this one engine: it may release the float arrays it converts (Model.exclusive).
        loaded = model if isinstance(model, Model) else load_model(model, progress=progress, exclusive=True)
        engine = create_engine(backend, model=loaded, config=engine_config)
        self._setup(engine, loaded.tokenizer, tools, max_queue)
        self.model = loaded

    @classmethod
    def from_engine(cls, engine: Any, tokenizer: Any = None, *, tools: Any = True, max_queue: int = 1024) -> "LLM":
        """Drive an already built engine (any object implementing the protocol)."""
        self = cls.__new__(cls)
        self._setup(engine, tokenizer, tools, max_queue)
        self.model = getattr(engine, "model", None)
        return self

    def _setup(self, engine: Any, tokenizer: Any, tools: Any, max_queue: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.tools = None
        if not isinstance(tools, (bool, list, tuple)) and tools is not None:
            raise InvalidRequest(f"tools must be True, False or a list of polyengine.tools.Tool, not {type(tools).__name__}",
                                 field="tools")
        if tools and tokenizer is not None:
            from polyengine.tools import ToolMachine

            self.tools = ToolMachine.create(tokenizer, None if tools is True else list(tools))
        grammars = None
        if tokenizer is not None and getattr(engine.capabilities, "token_masks", False):
            from polyengine.driver.structured import Grammars

            grammars = Grammars(tokenizer, engine.vocab_size, engine.eos_token_ids)
        self.scheduler = Scheduler(
            engine,
            grammars=grammars,
            detokenizer_factory=(lambda ids: tokenizer.detokenizer(ids)) if tokenizer is not None else None,
            tool_factory=self.tools.new_row if self.tools is not None else None,
            skip_token_ids=frozenset(tokenizer.special_token_ids) if tokenizer is not None else frozenset(),
            max_queue=max_queue,
        )

    @property
    def page_stats(self) -> dict[str, int]:
        """The K/V page pool's counts and the preemptions so far (:meth:`Scheduler.page_stats`)."""
        return self.scheduler.page_stats()

    # -- prompts ---------------------------------------------------------------------------

    @property
    def max_prompt_chars(self) -> int:
        """Text longer than this cannot fit the engine's prefill, whatever the tokenizer
        makes of it; it is refused before tokenizing (which costs memory many times its size)."""
        return PROMPT_CHARS_PER_TOKEN * self.engine.max_prefill_length

    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """A prompt as ``(text or None, token ids)``; every refusal has ``field="prompt"``."""
        with _blaming("prompt"):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise InvalidRequest("this model has no tokenizer: pass prompts as lists of token ids")
                return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True,
                                                          max_chars=self.max_prompt_chars))
            limit = self.engine.max_prefill_length
            if hasattr(prompt, "__len__") and len(prompt) > limit:  # refused by its length, before reading it
                raise ContextLengthExceeded(
                    f"prompt has {len(prompt):,} tokens but this engine accepts at most {limit} (max_prefill_length); "
                    f"shorten it or build the engine with a larger max_prefill_length")
            try:
                return None, token_ids(prompt, "prompt")
            except TypeError:
                raise InvalidRequest(
                    f"a prompt must be a string or a sequence of token ids, not {type(prompt).__name__}") from None

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Render a conversation with the model's template (generation prompt added) and
        encode it; every refusal (the template's included) has ``field="messages"``."""
        with _blaming("messages"):
            if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
                raise InvalidRequest("this model has no chat template: use generate() with a raw prompt")
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
            return list(self.tokenizer.encode(text, add_special_tokens=False, max_chars=self.max_prompt_chars,
                                              what="the rendered conversation"))

    # -- requests --------------------------------------------------------------------------

    def submit(self, prompt: Prompt, sampling: SamplingParams | dict | None = None, *,
               cache_salt: str | None = None) -> Request:
        """Queue one request without running it; ``step()`` or any other call advances it.

        Raises InvalidRequest (bad or too-long prompt, bad parameters), UnsupportedFeature
        or QueueFull at once; requests already running are not affected. ``cache_salt``
        (every method that takes a prompt has it): the request continues and fills only
        prefix cache entries of requests with the same salt (None: of those with none).
        """
        text, ids = self.encode(prompt)
        return self.scheduler.submit(ids, SamplingParams.coerce(sampling), prompt=text, cache_salt=cache_salt)

    def step(self) -> bool:
        """Advance every request by one engine step; return whether work remains."""
        return self.scheduler.step()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[Completion]:
        """Complete every prompt; one Completion per prompt, in order.

        Every prompt is validated before any runs: one bad prompt refuses the call
        (InvalidRequest naming the prompt) and nothing of it is queued. A batch larger
        than the queue is fed in as the queue drains.
        """
        batch = self._as_batch(prompts)
        if isinstance(sampling, (list, tuple)):
            if len(sampling) != len(batch):
                raise InvalidRequest(f"{len(sampling)} sampling parameter sets for {len(batch)} prompts", field="sampling")
            params = [SamplingParams.coerce(s) for s in sampling]
        else:
            params = [SamplingParams.coerce(sampling)] * len(batch)
        reqs: list[Request] = []
        for i, (p, sp) in enumerate(zip(batch, params)):
            try:
                text, ids = self.encode(p)
                reqs.append(self.scheduler.prepare(ids, sp, prompt=text, cache_salt=cache_salt))
            except InvalidRequest as exc:
                raise type(exc)(f"prompt {i}: {exc}", field=exc.field) from None
        try:
            for req in reqs:
                while self.scheduler.queue_full:
                    self.scheduler.step()
                self.scheduler.enqueue(req)
            self.scheduler.run_until(lambda: all(r.done for r in reqs))
        except BaseException:
            for r in reqs:
                r.cancel()
            raise
        return [r.completion for r in reqs]

    def stream(self, prompt: Prompt, sampling: SamplingParams | dict | None = None, *,
               cache_salt: str | None = None) -> Iterator[StreamDelta]:
        """Yield text deltas (with their token ids) as they are produced.

        The request is queued at once. Closing the iterator, or dropping it, cancels the
        request and frees its slots, even before the first delta was asked for.
        """
        req = self.submit(prompt, sampling, cache_salt=cache_salt)
        return _Stream(self._drain(req), req, self.scheduler)

    def _drain(self, req: Request) -> Iterator[StreamDelta]:
        try:
            while True:
                while req.events:
                    yield req.events.popleft()
                if req.done:
                    if req.error is not None:
                        raise req.error
                    return
                self.scheduler.step()
        finally:
            if not req.done:
                req.cancel()

    def chat(self, messages: list[dict[str, Any]], sampling: SamplingParams | dict | None = None, *,
             tools: Sequence[dict[str, Any]] | None = None, tool_choice: Any = None,
             cache_salt: str | None = None) -> Completion:
        """Answer a conversation (a list of ``{"role", "content"}`` messages).

        ``tools``: OpenAI function definitions (``{"type": "function", "function": {"name",
        "description", "parameters"}}``); ``tool_choice``: ``"auto"`` (default with tools),
        ``"none"``, ``"required"`` or ``{"type": "function", "function": {"name": ...}}``
        (the last two enforced by a grammar). Calls the model makes come back in each
        output's ``tool_calls`` with ``finish_reason == "tool_calls"``
        (:mod:`polyengine.driver.toolcalls` has the format)."""
        if tools is None and tool_choice is None:
            return self.generate([self.apply_chat_template(messages)], sampling, cache_salt=cache_salt)[0]
        from polyengine.driver.toolcalls import parse_tool_calls

        ids, sp, tools, choice = self.tool_chat_prompt(messages, SamplingParams.coerce(sampling), tools, tool_choice)
        done = self.generate([ids], sp, cache_salt=cache_salt)[0]
        if choice != "none":
            for out in done.outputs:
                content, calls = parse_tool_calls(out.text, tools)
                if calls:
                    out.text, out.tool_calls, out.finish_reason = content or "", calls, "tool_calls"
        return done

    def tool_chat_prompt(self, messages: list[dict[str, Any]], sampling: SamplingParams, tools: Any,
                         tool_choice: Any) -> tuple[list[int], SamplingParams, list[dict[str, Any]], Any]:
        """A conversation with tools as prompt ids, the request's sampling (constrained to
        a call when ``tool_choice`` forces one), the checked tools and the choice."""
        from polyengine.driver.toolcalls import prepare_chat

        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest("this model has no chat template: use generate() with a raw prompt")
        text, sp, tools, choice = prepare_chat(self.tokenizer, messages, sampling, tools, tool_choice)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False, max_chars=self.max_prompt_chars,
                                         what="the rendered conversation"))
        return ids, sp, tools, choice

    def stream_chat(self, messages: list[dict[str, Any]], sampling: SamplingParams | dict | None = None, *,
                    cache_salt: str | None = None) -> Iterator[StreamDelta]:
        return self.stream(self.apply_chat_template(messages), sampling, cache_salt=cache_salt)

    def embed(self, prompts: Prompt | Sequence[Prompt], *, normalize: bool = True) -> np.ndarray:
        """One embedding per prompt, ``(len(prompts), hidden_size)`` float32: the mean of
        the prompt's final hidden states, L2-normalised unless ``normalize=False``
        (:mod:`polyengine.driver.embeddings`). Every prompt is checked before any runs;
        a backend without capability ``embeddings`` raises UnsupportedFeature."""
        batch = self._as_batch(prompts)
        if not batch:
            raise InvalidRequest("no prompts to embed: pass at least one", field="prompt")
        ids = []
        for i, p in enumerate(batch):
            try:
                ids.append(self.scheduler.check_embed(self.encode(p)[1]))
            except InvalidRequest as exc:
                raise type(exc)(f"prompt {i}: {exc}" if len(batch) > 1 else str(exc), field=exc.field) from None
        return np.stack([self.scheduler.embed(t, normalize=normalize) for t in ids])

    @staticmethod
    def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if not isinstance(prompts, Sequence) and not hasattr(prompts, "__array__"):
            raise InvalidRequest(f"prompts must be a string, a list of token ids or a list of prompts, "
                                 f"not {type(prompts).__name__}", field="prompt")
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts


@contextlib.contextmanager
def _blaming(field: str) -> Iterator[None]:
    """An InvalidRequest raised inside that names no field is about ``field``."""
    try:
        yield
    except InvalidRequest as exc:
        if exc.field is None:
            exc.field = field
        raise


class _Stream(Iterator[StreamDelta]):
    """What :meth:`LLM.stream` returns. A bare generator would not do: closing or
    dropping one that was never started runs none of its code, so its request would
    stay queued, holding a place in the queue and later a slot."""

    def __init__(self, deltas: Iterator[StreamDelta], req: Request, scheduler: Scheduler):
        self._deltas, self._req, self._scheduler = deltas, req, scheduler

    def __next__(self) -> StreamDelta:
        return next(self._deltas)

    def close(self) -> None:
        self._deltas.close()  # type: ignore[attr-defined]
        self._req.cancel()

    def __del__(self) -> None:
        # May run inside a garbage collection, in the middle of the scheduler's own work:
        # hand the request over instead of cancelling it here.
        if not self._req.done:
            self._scheduler.abandon(self._req)
