"""Test backends for the async driver and the server, registered in-process.

``test_slow`` is the reference engine in float32 that sleeps ``STEP_DELAY`` seconds in
every ``prefill`` and ``generate`` (so a request lasts long enough to disconnect, fill
the queue or shut down mid-stream on any machine) and declares less than the
reference, like tests/restricted_backend.py: no penalties, no min_p, no bulk_insert
(so n > 1 is refused), at most 4 top log-probs.

``test_dying`` is the same engine whose first ``generate`` raises ``EngineDead`` (its
device is gone: the server must report a dead engine, not hang; a backend's
``SystemExit`` fails only the requests of that call, tests/test_hostile_round3_engine.py).
``test:slow-tokenizer`` is a model name (``random:tiny`` whose tokenizer takes
``TOKENIZE_DELAY`` seconds per text, sleeping, so the GIL is free): a server that
tokenized on its event loop would stall ``/health`` that long.

``tests/serve_test_backends.py`` registers this module and runs the serve command,
so the server tests drive these backends through the real CLI.
"""

from __future__ import annotations

import time

from polyengine import PROTOCOL_VERSION, BackendSpec, Capabilities, EngineConfig, Probe, hookimpl
from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.errors import EngineDead, UnsupportedFeature
from polyengine.models import Model
from polyengine.sampling.params import ENGINE_FIELDS

STEP_DELAY = 0.025
TOKENIZE_DELAY = 3.0
UNDECLARED = frozenset({"repetition_penalty", "presence_penalty", "frequency_penalty", "min_p"})


class SlowEngine(ReferenceEngine):
    name = "test_slow"

    def __init__(self, model: Model, config: EngineConfig, delay: float = STEP_DELAY):
        super().__init__(model, config.model_copy(update={"dtype": "float32"}))
        self.delay = delay
        self.capabilities = Capabilities(dtypes=("float32",), sampling_params=ENGINE_FIELDS - UNDECLARED,
                                         max_top_logprobs=4)

    def prefill(self, *, params, tokens, sampling, existing_prefix=None):
        time.sleep(self.delay)
        return super().prefill(params=params, tokens=tokens, sampling=sampling, existing_prefix=existing_prefix)

    def generate(self, params, decode_state, *, overrides=None):
        time.sleep(self.delay)
        return super().generate(params, decode_state, overrides=overrides)

    def bulk_insert(self, prefix, decode_state, slots):
        raise UnsupportedFeature("bulk_insert", self.name)


def create_slow_engine(*, model: Model, config: EngineConfig) -> SlowEngine:
    return SlowEngine(model, config)


class DyingEngine(SlowEngine):
    name = "test_dying"

    def generate(self, params, decode_state, *, overrides=None):
        time.sleep(self.delay)
        raise EngineDead("the device went away (test_dying)")


def create_dying_engine(*, model: Model, config: EngineConfig) -> DyingEngine:
    return DyingEngine(model, config)


@hookimpl
def polyengine_backends():
    return [
        BackendSpec(
            name="test_slow", description="reference engine, slow and declaring little (tests/serving_backends.py)",
            protocol_version=PROTOCOL_VERSION, probe=lambda: Probe(True), factory=create_slow_engine,
        ),
        BackendSpec(
            name="test_dying", description="test_slow whose first generate raises EngineDead (tests/serving_backends.py)",
            protocol_version=PROTOCOL_VERSION, probe=lambda: Probe(True), factory=create_dying_engine,
        ),
    ]


class _SlowTokenizer:
    """A tokenizer that takes TOKENIZE_DELAY seconds per text (asleep: the GIL is free)."""

    def __init__(self, inner):
        self._inner = inner

    def encode(self, *args, **kwargs):
        time.sleep(TOKENIZE_DELAY)
        return self._inner.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _slow_tokenizer_model() -> Model:
    from polyengine.models import load_model

    model = load_model("random:tiny")
    model.tokenizer = _SlowTokenizer(model.tokenizer)
    return model


@hookimpl
def polyengine_models():
    return {"test:slow-tokenizer": _slow_tokenizer_model}
