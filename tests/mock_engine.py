"""A mock backend whose outputs can be computed by hand (JetStream's idea).

Prefill's first token is ``sum(prompt) % vocab``; each generate step feeds the slot's
last token ``t`` (or the override) and yields ``(t + 1 + slot_offset) % vocab`` where
the offset is the request's ``sample_index``. It declares no sampling parameters, so
any request that sets one is refused with UnsupportedFeature, as the protocol asks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from polyengine import PROTOCOL_VERSION, BackendSpec, Capabilities, EngineBase, Prefix, Probe, ResultTokens, hookimpl
from polyengine.models import Model, ModelConfig

CONFIG = ModelConfig(
    vocab_size=50, hidden_size=4, intermediate_size=4, num_hidden_layers=1,
    num_attention_heads=1, num_key_value_heads=1, head_dim=4, eos_token_ids=(49,),
)


def tiny_model() -> Model:
    weights = {name: np.zeros(shape, np.float32) for name, shape in CONFIG.weight_shapes().items()}
    return Model(CONFIG, weights, source="mock")


@dataclass
class MockState:
    num_slots: int
    last: list[int | None] = field(default_factory=list)
    offset: list[int] = field(default_factory=list)
    length: list[int] = field(default_factory=list)


class MockEngine(EngineBase):
    name = "mock"

    def __init__(self, model: Model, config):
        super().__init__(model, config, Capabilities(dtypes=("int",), sampling_params=frozenset(), bulk_insert=True))

    def load_params(self):
        return "mock-params"

    def init_decode_state(self) -> MockState:
        n = self.max_concurrent_decodes
        return MockState(n, [None] * n, [0] * n, [0] * n)

    def prefill(self, *, params, tokens, sampling, existing_prefix=None):
        toks, sampling, _ = self.check_prefill(tokens, sampling, existing_prefix)
        first = int(toks.sum()) % self.vocab_size
        prefix = Prefix(kv=None, logits=None, prompt_tokens=toks, sampling=sampling, backend=self.name, first_token=first, model_id=self.model_id)
        return prefix, ResultTokens(tokens=[[first]], valid=[[True]], lengths=[1])

    def insert(self, prefix, decode_state, slot):
        slot = self.check_empty_slot(slot, lambda i: decode_state.last[i] is not None)
        decode_state.last[slot] = prefix.first_token
        decode_state.offset[slot] = 0
        decode_state.length[slot] = 1
        return decode_state

    def bulk_insert(self, prefix, decode_state, slots):
        slots = self.check_bulk_slots(slots, lambda i: decode_state.last[i] is not None)
        firsts = []
        for i, s in enumerate(slots):
            first = (prefix.first_token + i) % self.vocab_size
            decode_state.last[s], decode_state.offset[s], decode_state.length[s] = first, i, 1
            firsts.append([first])
        return decode_state, ResultTokens(tokens=firsts, valid=[[True]] * len(slots), lengths=[1] * len(slots))

    def generate(self, params, decode_state, *, overrides=None):
        forced = self.check_overrides(overrides, lambda i: None if decode_state.last[i] is None else (decode_state.length[i], 1))
        for slot, (tok, _) in forced.items():
            decode_state.last[slot] = tok
        n = decode_state.num_slots
        tokens, valid = np.zeros((n, 1), np.int32), np.zeros((n, 1), bool)
        for s in range(n):
            if decode_state.last[s] is None:
                continue
            tok = (decode_state.last[s] + 1 + decode_state.offset[s]) % self.vocab_size
            decode_state.last[s] = tok
            decode_state.length[s] += 1
            tokens[s, 0], valid[s, 0] = tok, True
        return decode_state, ResultTokens(tokens=tokens, valid=valid, lengths=np.array(decode_state.length))

    def free_resource(self, decode_state, slot):
        slot = self.check_slot(slot)
        decode_state.last[slot] = None
        decode_state.length[slot] = 0
        return decode_state


def create_engine(*, model, config):
    return MockEngine(model, config)


class MockPlugin:
    """The test plugin that registers the mock backend."""

    def __init__(self, name: str = "mock", *, available: bool = True, accelerator: bool = False,
                 kind: str | None = None, priority: int = 0, accelerator_priority: int = 0,
                 extra: str | None = None, install_hint: str | None = None):
        self.spec = BackendSpec(
            name=name, description="hand-computable mock backend for tests",
            protocol_version=PROTOCOL_VERSION,
            probe=lambda: Probe(available, accelerator, "ok" if available else "mock hardware missing"),
            factory=create_engine, priority=priority, accelerator=kind, extra=extra,
            accelerator_priority=accelerator_priority, install_hint=install_hint,
        )

    @hookimpl
    def polyengine_backends(self):
        return [self.spec]
