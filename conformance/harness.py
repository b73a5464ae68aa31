"""What the tests stand on: engines built once per class, a hand driver for slots,
stream comparison with the oracle, and the per-test context that records tolerances
and measured errors for the report.

The suite builds every engine through the backend's factory with the same limits
(:data:`LIMITS`), so a compiled backend compiles each test model once per dtype
(plus two bucket variants of the default model for the padding checks).
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import platform
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from polyengine.engine import Capabilities, EngineConfig, Override, Prefix, ResultTokens
from polyengine.errors import BackendUnavailable, UnsupportedFeature
from polyengine.hostinfo import cpu_model
from polyengine.models import Model
from polyengine.sampling import RowState, SamplingParams

from polyengine.conformance.models import ALL_MODEL_NAMES, DEFAULT_MODEL, MODEL_SEED, architecture_of, build_model
from polyengine.conformance.oracle import Decision, ReferenceOracle, decide, oracle_for
from polyengine.conformance.tolerances import Tolerance, Tolerances
from polyengine.conformance.xfail import XfailList

__all__ = ["LIMITS", "VARIANTS", "SEEDS", "SlotDriver", "Divergence", "first_divergence", "Harness", "Context"]

# One set of limits for every engine the suite builds: 4 slots, prompts up to 24.
LIMITS = dict(max_slots=4, max_prefill_length=24, max_cache_length=64)
# Prefill bucket variants of the default model (padding must not change results).
VARIANTS: dict[str, dict[str, Any]] = {
    "standard": {},
    "buckets": {"prefill_buckets": (8, 16, 24)},
    "one_bucket": {"prefill_buckets": (24,)},
}
# Every random choice the suite makes, recorded in the report.
SEEDS = {"model": MODEL_SEED, "prompts": 7, "sampling": 1000, "statistics": 5000, "differential": 20200}


class SlotDriver:
    """Drive an engine by hand: prefill, insert, generate, free; keep each slot's tokens.

    ``tokens[slot]`` is the completion of the request in that slot (first token
    included), ``logprobs[slot]``/``top[slot]`` what the backend reported with them,
    ``last[slot]`` how many tokens the slot's last result gave (an override may replace
    any of them, see :class:`~polyengine.engine.Override`). Works for any
    ``tokens_per_step``.
    """

    def __init__(self, engine: Any, params: Any):
        self.engine, self.params = engine, params
        self.state = engine.init_decode_state()
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float]] = {}
        self.top: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        self.last: dict[int, int] = {}
        self.live: set[int] = set()

    def prefill(self, prompt: Sequence[int], sampling: SamplingParams) -> tuple[Prefix, ResultTokens]:
        return self.engine.prefill(params=self.params, tokens=list(prompt), sampling=sampling)

    def _record(self, slot: int, result: ResultTokens, row: int) -> None:
        toks = result.row_tokens(row)
        self.last[slot] = len(toks)
        self.tokens.setdefault(slot, []).extend(toks)
        if result.logprobs is not None:
            lps = [float(x) for x, v in zip(result.logprobs[row], result.valid[row]) if v]
            self.logprobs.setdefault(slot, []).extend(lps)
        if result.top_ids is not None and result.top_logprobs is not None:
            for j, v in enumerate(result.valid[row]):
                if v:
                    self.top.setdefault(slot, []).append((result.top_ids[row, j], result.top_logprobs[row, j]))

    def _start(self, slot: int) -> None:
        self.tokens[slot], self.logprobs[slot], self.top[slot] = [], [], []
        self.live.add(slot)

    def insert(self, slot: int, prompt: Sequence[int], sampling: SamplingParams) -> Prefix:
        prefix, first = self.prefill(prompt, sampling)
        self.insert_prefix(slot, prefix, first)
        return prefix

    def insert_prefix(self, slot: int, prefix: Prefix, first: ResultTokens | None = None) -> None:
        self.state = self.engine.insert(prefix, self.state, slot)
        self._start(slot)
        if first is not None:
            self._record(slot, first, 0)
        else:
            self.tokens[slot].append(int(prefix.first_token))
            self.last[slot] = 1

    def bulk_insert(self, slots: Sequence[int], prefix: Prefix) -> ResultTokens:
        self.state, first = self.engine.bulk_insert(prefix, self.state, list(slots))
        for row, slot in enumerate(slots):
            self._start(slot)
            self._record(slot, first, row)
        return first

    def force(self, slot: int, token: int, position: int) -> Override:
        """An override making completion token ``position`` of ``slot`` be ``token``; the
        driver's record is cut there as the engine's is."""
        del self.tokens[slot][position:]
        del self.logprobs[slot][position:]
        del self.top[slot][position:]
        self.tokens[slot].append(int(token))
        return Override(int(token), position)

    def step(self, overrides: Mapping[int, Any] | None = None, n: int = 1) -> ResultTokens:
        for _ in range(n):
            self.state, result = self.engine.generate(self.params, self.state, overrides=dict(overrides or {}))
            overrides = None
            for slot in sorted(self.live):
                self._record(slot, result, slot)
        return result

    def mixed_step(self, requests: Sequence[Any], overrides: Mapping[int, Any] | None = None) -> list[Any]:
        """One ``generate_with_prefill`` call (capability ``mixed_step``): the step recorded
        as :meth:`step` records one; returns the entries' ``(Prefix, ResultTokens)``."""
        self.state, result, out = self.engine.generate_with_prefill(self.params, self.state, requests=list(requests),
                                                                   overrides=dict(overrides or {}))
        for slot in sorted(self.live):
            self._record(slot, result, slot)
        return out.result(timeout=600)

    def free(self, slot: int) -> None:
        self.state = self.engine.free_resource(self.state, slot)
        self.live.discard(slot)

    def run(self, slot: int, prompt: Sequence[int], sampling: SamplingParams, steps: int) -> list[int]:
        """Insert into ``slot`` and generate until the slot has ``steps`` tokens."""
        self.insert(slot, prompt, sampling)
        while len(self.tokens[slot]) < steps:
            before = len(self.tokens[slot])
            self.step()
            if len(self.tokens[slot]) == before:
                raise AssertionError(
                    f"slot {slot} produced no valid token in a generate step after {before} tokens "
                    f"(its cache has room for {self.engine.max_cache_length - len(prompt) - before} more)"
                )
        return self.tokens[slot][:steps]


@dataclass
class Divergence:
    step: int
    got: int
    want: int
    gap: float
    near_tie: bool

    def describe(self) -> str:
        return (
            f"step {self.step}: backend chose token {self.got}, the reference {self.want} "
            f"(reference margin {self.gap:.3g})"
        )


def first_divergence(got: Sequence[int], want: Sequence[Decision], tie_gap: float) -> Divergence | None:
    for i, (g, w) in enumerate(zip(got, want)):
        if int(g) != w.token:
            return Divergence(i, int(g), w.token, w.gap, w.gap < tie_gap)
    return None


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> Mapping[str, list[str]]:
    """Top-level package -> distributions, read once per process: it parses the file list
    of every installed distribution (~0.15 s of CPU with torch, jax and ray installed), and
    each report (each run of the suite in a process, twice with a JSON report) asks for it."""
    return md.packages_distributions()


def _distribution_of(obj: Any) -> tuple[str | None, str | None]:
    """The installed distribution that provides ``obj``'s top-level package, if any."""
    top = type(obj).__module__.split(".")[0]
    try:
        dists = _packages_distributions().get(top) or []
        if dists:
            return dists[0], md.version(dists[0])
    except Exception:  # metadata of some installed package is broken: not ours to judge
        pass
    return None, None


class Harness:
    """Per test class (one backend): the factory, its engines, tolerances and xfails."""

    def __init__(
        self,
        factory: Callable[..., Any],
        *,
        tolerances: Any = None,
        xfail: Any = None,
        metadata: Mapping[str, Any] | None = None,
        test_names: Sequence[str] = (),
        test_ids: Sequence[str] = (),
        options: Mapping[str, Any] | None = None,
        stop_when_unavailable: bool = False,
    ):
        if not callable(factory):
            raise TypeError(
                f"the engine_factory fixture must return a callable factory(model=Model, "
                f"config=EngineConfig) -> Engine, got {type(factory).__name__}"
            )
        self.factory = factory
        self.tolerances = Tolerances(tolerances, known_tests=test_names, known_models=ALL_MODEL_NAMES)
        # engine options every engine of this run is built with (an option set), and how it is judged
        self.options = dict(options or {})
        self.option_set = self.tolerances.use_options(self.options)
        self.xfail = XfailList.load(xfail)
        self.xfail.check_against(test_ids)
        self.metadata = dict(metadata or {})
        self._engines: dict[tuple[str, str | None, str], Any] = {}
        # engine id -> (engine, params). Holding the engine keeps its id from being
        # reused by another engine while this entry lives (ids of freed objects are).
        self._params: dict[int, tuple[Any, Any]] = {}
        self._default: Any = None
        # the model default_engine runs: DEFAULT_MODEL, or under an option set it refuses
        # (one that applies to quantized models only), the first model that takes it
        self.default_model = DEFAULT_MODEL
        # registry mode (the run is this backend's alone): a backend that cannot be built here
        # stops the run once; a subclass in someone's test session fails its tests instead
        self.stop_when_unavailable = stop_when_unavailable
        self.cache: dict[Any, Any] = {}  # results several tests share (e.g. sampler draws)

    # -- engines -------------------------------------------------------------------------

    def config(self, dtype: str | None, variant: str = "standard", **changes: Any) -> EngineConfig:
        return EngineConfig(**{**LIMITS, **VARIANTS[variant], "dtype": dtype, "options": dict(self.options), **changes})

    def build(self, model: Model, config: EngineConfig) -> Any:
        return self.factory(model=model, config=config)

    @property
    def default_engine(self) -> Any:
        """The default model's engine in the backend's default dtype (``dtype=None``)."""
        if self._default is None:
            # Not reused for explicit dtypes: nothing says which dtype a backend's default is.
            try:
                self._default = self.build(build_model(DEFAULT_MODEL), self.config(None))
            except UnsupportedFeature as exc:
                if not self.options:
                    raise
                self._default = self._first_taking_options(exc)
            except BackendUnavailable as exc:
                if not self.stop_when_unavailable:
                    raise
                # Every test would fail with this same error (cuda_torch on a host without a
                # GPU: 281 failures): say it once and stop the run, nothing tested.
                import pytest

                pytest.exit(f"{exc}. Nothing was tested: run the suite where the backend is available, or pass "
                            f"the options that make it runnable here (--option KEY=VALUE)", returncode=4)
        return self._default

    def _first_taking_options(self, refusal: UnsupportedFeature) -> Any:
        """Under an option set the default model refuses (an option for quantized weights
        only): the engine of the first conformance model that takes it, which the
        surface layer and the capabilities then read; the default model's own tests skip
        (``engine`` below). No model takes it: every test skips, saying so."""
        for name in ALL_MODEL_NAMES:
            if name == DEFAULT_MODEL:
                continue
            try:
                engine = self.build(build_model(name), self.config(None))
            except UnsupportedFeature:
                continue
            self.default_model = name
            return engine
        import pytest

        pytest.skip(f"the backend refuses options {self.options} for every conformance model: {refusal}")

    @property
    def capabilities(self) -> Capabilities:
        return self.default_engine.capabilities

    @property
    def primary_dtype(self) -> str:
        """The dtype the contract, sampler and honesty layers run in: the first declared."""
        return self.capabilities.dtypes[0]

    def engine(self, model: str = DEFAULT_MODEL, dtype: str | None = None, variant: str = "standard") -> Any:
        dtype = dtype or self.primary_dtype
        key = (model, dtype, variant)
        if key not in self._engines:
            self._engines[key] = self.build_for(model, self.config(dtype, variant))
        return self._engines[key]

    def build_for(self, model: str, config: EngineConfig) -> Any:
        """An engine of conformance model ``model`` under ``config``; under an option set
        that does not apply to it (int8 weights of a mixture of experts, block options on
        a float model), refused at construction as the protocol asks: the test skips."""
        try:
            return self.build(build_model(model), config)
        except UnsupportedFeature as exc:
            if not self.options:
                raise
            import pytest

            pytest.skip(f"the backend refuses options {self.options} for model {model}: {exc}")

    def params(self, engine: Any) -> Any:
        entry = self._params.get(id(engine))
        if entry is None or entry[0] is not engine:
            entry = self._params[id(engine)] = (engine, engine.load_params())
        return entry[1]

    def oracle(self, model: str = DEFAULT_MODEL) -> ReferenceOracle:
        return oracle_for(build_model(model))

    # -- report --------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Backend facts for the report (name, distribution, device, capabilities, seeds)."""
        out: dict[str, Any] = {"name": None, "distribution": None, "version": None}
        out.update({k: v for k, v in self.metadata.items() if v is not None})
        import pytest

        try:
            engine = self.default_engine
        except (Exception, pytest.skip.Exception) as exc:  # the engine does not build: the tests say why
            out.setdefault("error", f"{type(exc).__name__}: {exc}")
            engine = None
        if engine is not None:
            out["name"] = out["name"] or getattr(engine, "name", None)
            if out["distribution"] is None:
                out["distribution"], out["version"] = _distribution_of(engine)
            caps = getattr(engine, "capabilities", None)
            if isinstance(caps, Capabilities):
                out["capabilities"] = caps.model_dump(mode="json")
                out["capabilities"]["sampling_params"] = sorted(caps.sampling_params)
        out["device"] = {
            "platform": platform.platform(),
            "cpu": cpu_model(),
            "python": platform.python_version(),
            "backend": None if engine is None else getattr(engine, "device", None),
        }
        out["options"] = None if self.option_set is None else self.option_set.to_dict()
        out["default_model"] = self.default_model  # another where the options refuse DEFAULT_MODEL
        out["seeds"] = dict(SEEDS)
        out["limits"] = dict(LIMITS)
        out["models"] = {name: build_model(name).config.model_dump(mode="json") for name in ALL_MODEL_NAMES}
        return out


@dataclass
class Context:
    """One test's view: the class's harness plus a record of what the test measured."""

    harness: Harness
    test_name: str  # the function name (tolerance overrides select on it)
    test_id: str  # name[params] (xfail entries and the report use it)
    record: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.record.setdefault("tolerances", {})
        self.record.setdefault("notes", [])

    # shortcuts to the harness
    def engine(self, model: str = DEFAULT_MODEL, dtype: str | None = None, variant: str = "standard") -> Any:
        return self.harness.engine(model, dtype, variant)

    def driver(self, engine: Any) -> SlotDriver:
        return SlotDriver(engine, self.harness.params(engine))

    def oracle(self, model: str = DEFAULT_MODEL) -> ReferenceOracle:
        return self.harness.oracle(model)

    @property
    def capabilities(self) -> Capabilities:
        return self.harness.capabilities

    @property
    def dtype(self) -> str:
        return self.harness.primary_dtype

    def declares(self, field_name: str) -> bool:
        return field_name in self.capabilities.sampling_params

    def require_dtype(self, dtype: str) -> None:
        import pytest

        if dtype not in self.capabilities.dtypes:
            pytest.skip(
                f"dtype {dtype} is not declared (Capabilities.dtypes={list(self.capabilities.dtypes)}); "
                f"its refusal is tested by test_dtype[{dtype}]"
            )

    def require_architecture(self, model: str) -> None:
        """Skip a test on a model whose architecture the backend does not declare (its
        refusal is tested by ``test_architecture``)."""
        import pytest

        arch = architecture_of(model)
        if arch not in self.capabilities.architectures:
            pytest.skip(f"architecture {arch!r} (model {model}) is not declared (Capabilities.architectures="
                        f"{list(self.capabilities.architectures)}); its refusal is tested by test_architecture[{model}]")

    def require_params(self, *names: str) -> None:
        import pytest

        missing = [n for n in names if not self.declares(n)]
        if missing:
            pytest.skip(
                f"sampling parameter(s) {', '.join(missing)} not declared; their refusal is tested "
                f"by test_sampling_parameter"
            )

    # tolerances and measurements
    def tolerance(self, quantity: str, dtype: str, model: str | None = None) -> Tolerance:
        return self.harness.tolerances.get(quantity, test=self.test_name, dtype=dtype, model=model)

    def measure(self, quantity: str, measured: float, dtype: str, model: str | None = None, where: str = "") -> Tolerance:
        """Record a measured error (the largest per quantity) and return its tolerance."""
        tol = self.tolerance(quantity, dtype, model)
        entry = self.record["tolerances"].setdefault(quantity, {**tol.to_dict(), "measured": 0.0})
        if not entry["measured"] >= measured:  # also replaces a NaN with the new value
            entry.update(measured=float(measured), where=where, **tol.to_dict())
        return tol

    def within(self, quantity: str, measured: float, dtype: str, model: str | None = None, what: str = "") -> None:
        """Record ``measured`` and fail, naming the tolerance's source, if it exceeds it."""
        tol = self.measure(quantity, measured, dtype, model, where=what)
        if not measured <= tol.value:
            raise AssertionError(
                f"{what}: {quantity} = {measured:.3g} exceeds the tolerance {tol.value:.3g} "
                f"({tol.source}{'; reason: ' + tol.reason if tol.reason else ''})"
            )

    def note(self, text: str) -> None:
        """Something reported but not failed (a divergence at a near tie, a boundary sample)."""
        self.record["notes"].append(text)

    # inputs
    def prompt(self, length: int, salt: int, model: str = DEFAULT_MODEL) -> list[int]:
        """A deterministic prompt of random token ids (salt picks which)."""
        vocab = build_model(model).config.vocab_size
        rng = np.random.default_rng([SEEDS["prompts"], salt, length])
        return [int(t) for t in rng.integers(0, vocab, size=length)]

    def sampling(self, salt: int, **changes: Any) -> SamplingParams:
        """A seeded request (temperature 1 unless changed; seed from the suite's seeds).
        ``top_logprobs`` is capped by the backend's declared ``max_top_logprobs``: the
        suite never asks more than a backend says it can give, except where a test
        checks the refusal."""
        if "top_logprobs" in changes:
            changes["top_logprobs"] = min(changes["top_logprobs"], self.capabilities.max_top_logprobs)
        return SamplingParams(**{"temperature": 1.0, "seed": SEEDS["sampling"] + salt, **changes})

    # judging token streams
    def _tie_gap(self, model: str, dtype: str | None) -> float:
        return self.tolerance("tie_gap", dtype or self.dtype, model).value

    def compare_to_oracle(
        self,
        got: Sequence[int],
        prompt: Sequence[int],
        sampling: SamplingParams,
        *,
        what: str,
        model: str = DEFAULT_MODEL,
        dtype: str | None = None,
        sample_index: int = 0,
        forced: Mapping[int, int] | None = None,
        masks: Mapping[int, np.ndarray] | None = None,
    ) -> Divergence | None:
        """The first divergence of ``got`` from the reference's stream (``masks``: per
        completion position, as :meth:`ReferenceOracle.stream`), or None.

        A divergence at a near tie (reference margin below ``tie_gap``) is noted for
        the report and returned with ``near_tie=True``: the streams legitimately part
        there, so callers stop comparing but do not fail.
        """
        want = self.oracle(model).stream(prompt, sampling, len(got), sample_index=sample_index, forced=forced, masks=masks)
        d = first_divergence(got, want, self._tie_gap(model, dtype))
        # The measured "error" of a token stream is the reference's margin where the
        # backend left it (0 when it never did): within tie_gap it is a near tie.
        self.measure("tie_gap", 0.0 if d is None else d.gap, dtype or self.dtype, model, where=what)
        if d is not None and d.near_tie:
            self.note(f"{what}: {d.describe()}, below tie_gap: a near tie, reported not failed")
        return d

    def compare_pair(
        self,
        got: Sequence[int],
        baseline: Sequence[int],
        prompt: Sequence[int],
        sampling: SamplingParams,
        *,
        what: str,
        model: str = DEFAULT_MODEL,
        dtype: str | None = None,
        sample_index: int = 0,
    ) -> Divergence | None:
        """Where two runs of the same request on this backend part, judged by the
        reference's margin at that point (a near tie is noted, not failed)."""
        for t, (a, b) in enumerate(zip(got, baseline)):
            if int(a) != int(b):
                common = [int(x) for x in baseline[:t]]
                row = RowState(sampling, sample_index, t, np.array(prompt), np.array(common, np.int64))
                gap = decide(self.oracle(model).logits(list(prompt) + common), row, self.oracle(model).eos_token_ids).gap
                d = Divergence(t, int(a), int(b), gap, gap < self._tie_gap(model, dtype))
                self.measure("tie_gap", gap, dtype or self.dtype, model, where=what)
                if d.near_tie:
                    self.note(f"{what}: step {t}: {a} vs {b} at a near tie (reference margin {gap:.3g}), reported not failed")
                return d
        if len(got) != len(baseline):
            return Divergence(min(len(got), len(baseline)), -1, -1, float("inf"), False)
        return None
