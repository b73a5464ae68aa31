"""The backend kit: one protocol declaration, EngineBase's refusals, packed results,
the shared memory check, and the driver over async and multi-token engines."""

from __future__ import annotations

import numpy as np
import pytest

from polyengine import EngineConfig, SamplingParams
from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.driver import LLM
from polyengine.engine import Capabilities, EngineBase, Override, ResultLayout, ResultTokens, protocol_problems
from polyengine.errors import InsufficientMemory, InvalidRequest, SlotError, UnsupportedFeature
from polyengine.memory import check_fits, simulated_limit
from polyengine.models import load_model

from honest_backends import AsyncEngine, SpeculativeEngine

CFG = EngineConfig(max_slots=3, max_prefill_length=16, max_cache_length=48)


@pytest.fixture(scope="module")
def model():
    return load_model("random:tiny")


# -- one declaration of the protocol ----------------------------------------------------------


def test_protocol_problems_names_what_is_missing_or_misnamed():
    class Half:
        name = "half"

        def prefill(self, *, params, tokens, sampling):  # no existing_prefix
            ...

        def generate(self, params, state, *, overrides=[]):  # misnamed, wrong default
            ...

    problems = protocol_problems(Half())
    assert "attribute 'capabilities' is missing" in problems
    assert "attribute 'device' is missing" in problems and "attribute 'model' is missing" in problems
    assert "prefill: needs keyword parameter 'existing_prefix'" in problems
    assert "generate: needs positional parameter 'decode_state'" in problems
    assert "generate: overrides must default to None" in problems
    assert any(p.startswith("method 'bulk_insert' is missing (optional, capability 'bulk_insert'") for p in problems)


def test_reference_and_kit_engines_satisfy_the_protocol(model):
    assert protocol_problems(ReferenceEngine(model, CFG)) == []


# -- EngineBase's refusals ---------------------------------------------------------------------


class _Kit(EngineBase):
    name = "kit"
    OPTIONS = {"graphs": True, "block": 16, "scale": 1.0, "buckets": ()}

    def __init__(self, model, config):
        super().__init__(model, config, Capabilities(dtypes=("float32", "bfloat16"), bulk_insert=True))


@pytest.mark.parametrize(("changes", "error", "phrase"), [
    ({"dtype": "float16"}, UnsupportedFeature, "declared dtypes: float32, bfloat16"),
    ({"options": {"graph": True}}, InvalidRequest, "unknown option(s) ['graph']"),
    ({"options": {"graphs": "yes"}}, InvalidRequest, "must be a bool"),
    ({"options": {"block": 1.5}}, InvalidRequest, "must be a int"),
    ({"options": {"buckets": "128"}}, InvalidRequest, "must be a tuple"),
    ({"max_cache_length": 10**6}, InvalidRequest, "exceeds the model's max_position_embeddings"),
])
def test_construction_refusals(model, changes, error, phrase):
    with pytest.raises(error, match=None) as exc:
        _Kit(model, CFG.model_copy(update=changes))
    assert phrase in str(exc.value)


def test_options_take_defaults_and_accept_ints_for_floats(model):
    eng = _Kit(model, CFG.model_copy(update={"options": {"scale": 2, "graphs": False}}))
    assert eng.options == {"graphs": False, "block": 16, "scale": 2, "buckets": ()}
    # JSON has lists, not tuples (--option buckets=[128,1024], a config file): taken as a tuple
    eng = _Kit(model, CFG.model_copy(update={"options": {"buckets": [128, 1024]}}))
    assert eng.options["buckets"] == (128, 1024)
    assert eng.dtype == "float32" and eng.device == "cpu" and eng.model is model


def test_check_overrides_positions(model):
    eng = _Kit(model, CFG)
    last = {0: (5, 3), 1: (2, 1)}.get  # slot 0: 5 tokens, the last 3 from its last step
    assert eng.check_overrides({0: 7, 1: Override(9)}, last) == {0: (7, 4), 1: (9, 1)}
    assert eng.check_overrides({0: Override(7, 2)}, last) == {0: (7, 2)}
    for bad, phrase in (({0: Override(7, 1)}, "positions 2..4"), ({0: Override(7, 5)}, "positions 2..4"),
                        ({2: 3}, "slot 2, which is empty"), ({0: 10**6}, "outside the vocabulary"),
                        ({0: 3.0}, "integer token id"), ({7: 3}, "out of range")):
        with pytest.raises(InvalidRequest, match=None) as exc:
            eng.check_overrides(bad, last)
        assert phrase in str(exc.value), (bad, str(exc.value))


def test_check_bulk_slots(model):
    eng = _Kit(model, CFG)
    occupied = {1}.__contains__
    assert eng.check_bulk_slots([2, 0], occupied) == [2, 0]
    for bad in ([0, 1], [2, 2], [], [0, 3], [-1]):
        with pytest.raises(SlotError):
            eng.check_bulk_slots(bad, occupied)


# -- memory -----------------------------------------------------------------------------------


def test_check_fits_names_what_where_and_both_numbers():
    with pytest.raises(InsufficientMemory) as exc:
        check_fits("the x backend", {"bf16 weights": 3 << 30, "KV cache": 1 << 30}, where="cuda:0 memory", available=2 << 30)
    msg = str(exc.value)
    assert "the x backend" in msg and "cuda:0 memory" in msg and "bf16 weights (3.00 GiB)" in msg
    assert exc.value.available == 2 << 30 and exc.value.needed > 4 << 30 and "max_slots" in msg
    assert check_fits("small", {"x": 1 << 20}, available=None, where="npu memory") > 0  # unknown: no check


def test_simulated_limit_applies_to_host_and_device_checks(model):
    with simulated_limit(1 << 20):
        with pytest.raises(InsufficientMemory):
            ReferenceEngine(model, CFG)
        with pytest.raises(InsufficientMemory):
            check_fits("d", {"x": 1 << 10}, where="cuda:0 memory", available=1 << 40)
    ReferenceEngine(model, CFG)


# -- packed results ---------------------------------------------------------------------------


def test_packed_results_round_trip_in_one_conversion():
    layout = ResultLayout(k=2, top_n=3, logprobs=True)
    rng = np.random.default_rng(0)
    fields = dict(
        tokens=rng.integers(0, 1000, (4, 2)), valid=np.array([[1, 1], [1, 0], [0, 0], [1, 1]], bool),
        lengths=np.array([5, 3, 0, 9]), logprobs=-rng.random((4, 2)).astype(np.float32),
        top_ids=rng.integers(0, 1000, (4, 2, 3)), top_logprobs=-rng.random((4, 2, 3)).astype(np.float32),
    )
    buf = layout.pack(**fields)
    assert buf.dtype == np.int32 and buf.shape == (4, layout.width)
    calls = {"start": 0, "host": 0}

    def start(b):
        calls["start"] += 1
        return ("handle", b)

    def host(h):
        calls["host"] += 1
        return h[1]

    r = ResultTokens.from_packed(buf, layout, to_host=host, start_copy=start)
    assert calls == {"start": 1, "host": 0}  # the copy starts at once; nothing is read yet
    for name, want in fields.items():
        np.testing.assert_array_equal(getattr(r, name), want)
    assert calls["host"] == 1  # one conversion for every field
    assert r.row_tokens(1) == [int(fields["tokens"][1, 0])] and r.num_rows == 4


def test_packed_layout_without_logprobs():
    layout = ResultLayout(k=1)
    r = ResultTokens.from_packed(layout.pack([[3], [4]], [[1], [0]], [1, 0]), layout)
    assert r.logprobs is None and r.top_ids is None and r.tokens.tolist() == [[3], [4]]
    with pytest.raises(ValueError):
        layout.unpack(np.zeros((2, 5), np.int32))


# -- the driver over async and multi-token engines ------------------------------------------


class _Recording(AsyncEngine):
    """Records when steps are dispatched and when their results are read."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self.events: list[str] = []

    def generate(self, params, decode_state, *, overrides=None):
        state, r = super().generate(params, decode_state, overrides=overrides)
        n = sum(e.startswith("dispatch") for e in self.events)
        self.events.append(f"dispatch {n}")
        to_host = r._to_host

        def read(handle, n=n):
            self.events.append(f"read {n}")
            return to_host(handle)

        r._to_host = read
        return state, r


def test_the_driver_pipelines_an_async_engine_and_matches_the_sync_one(model):
    prompts = [[1, 5, 9, 4], [1, 7, 3], [1, 2, 8, 8, 2]]
    sp = [SamplingParams(temperature=0.8, seed=s, max_tokens=7 + s) for s in range(3)]
    want = [c.token_ids for c in LLM.from_engine(ReferenceEngine(model, CFG), model.tokenizer, tools=False).generate(prompts, sp)]
    eng = _Recording(model, CFG)
    got = [c.token_ids for c in LLM.from_engine(eng, model.tokenizer, tools=False).generate(prompts, sp)]
    assert got == want
    # step n+1 was dispatched before step n was read
    assert eng.events.index("dispatch 1") < eng.events.index("read 0")


def test_tools_on_a_speculative_engine_keep_driver_and_engine_in_step(model):
    """With three tokens per step and tools on, each forced token replaces a token inside
    the engine's last result (Override positions), so the engine's completion equals the
    driver's, forced tokens included, and later tokens follow the forced context."""
    tok = model.tokenizer
    ps, pe = tok.token_to_id("<|python_start|>"), tok.token_to_id("<|python_end|>")
    expr = tok.encode("2+3")
    script = [ps, *expr, pe]

    class Steered(SpeculativeEngine):
        """Writes a tool call into the first completion tokens (a model that calls the tool)."""

        def _sample(self, logits, rows):
            out = super()._sample(logits, rows)
            for b, row in enumerate(rows):
                if row.step < len(script):
                    out.tokens[b] = script[row.step]
            return out

    eng = Steered(model, CFG)
    llm = LLM.from_engine(eng, tok)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))[0].outputs[0]
    block = [tok.token_to_id("<|output_start|>"), *tok.encode("5"), tok.token_to_id("<|output_end|>")]
    n = len(script)
    assert out.token_ids[:n + len(block)] == script + block
    assert out.forced[n:n + len(block)] == [1] * len(block)
    # the engine's own record of the completion agrees with the driver's, token for token
    ref = LLM.from_engine(ReferenceEngine(model, CFG), tok, tools=False)
    forced_prompt = [1, 2, 3] + out.token_ids[:n + len(block)]
    cont = ref.generate([forced_prompt], SamplingParams(temperature=0, max_tokens=14 - n - len(block), ignore_eos=True))
    assert out.token_ids[n + len(block):] == cont[0].token_ids


def test_engine_config_buckets_default_to_powers_of_two_up_to_the_prefill_limit():
    from polyengine import EngineConfig

    assert EngineConfig(max_prefill_length=100, max_cache_length=200).buckets() == (16, 32, 64, 100)
    assert EngineConfig(max_prefill_length=64, max_cache_length=200).buckets() == (16, 32, 64)
    assert EngineConfig(max_prefill_length=8, max_cache_length=20).buckets() == (8,)
    assert EngineConfig(max_prefill_length=40, max_cache_length=50, prefill_buckets=(8, 40)).buckets() == (8, 40)
    assert EngineConfig(max_prefill_length=100, max_cache_length=200).buckets(smallest=64) == (64, 100)


def test_hostinfo_reads_the_cpu_once():
    from polyengine import hostinfo

    assert hostinfo.cpu_model() and isinstance(hostinfo.cpu_flags(), frozenset)
    assert hostinfo.has_bf16_units() == bool({"amx_bf16", "avx512_bf16"} & hostinfo.cpu_flags())
    assert hostinfo._read.cache_info().currsize == 1
