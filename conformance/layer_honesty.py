"""Layer 5, parameter honesty: every parameter does what it says or is refused.

For each engine-side sampling parameter (``polyengine.sampling.params.ENGINE_FIELDS``):
declared in ``Capabilities.sampling_params``, it must have its specified effect (the
backend's stream equals the reference's with the parameter, and the suite checks
that the reference's stream without it differs, so the check has power); undeclared,
``prefill`` must raise ``UnsupportedFeature`` before any work, leaving running slots
untouched. Likewise for ``top_logprobs`` beyond ``max_top_logprobs`` and for dtypes
the backend does not declare. Refusals are tested, never skipped.

Each parameter is checked in several cases (:data:`EFFECTS`): greedy or at
temperature 1, and sampled at temperatures 0.5 and 1.7 wherever the parameter
interacts with the temperature: an additive term applied after the temperature
division, or a log-prob reported after it, is invisible at temperature 1. Cases
aimed at a known misimplementation (:data:`FAULTS`: logit_bias or penalties after
the temperature, min_tokens off by one) run four seeds side by side, assert that the
misimplementation's streams differ from the correct ones, and name it when the
backend draws exactly its tokens. Reported log-probs and top log-probs must be the
raw model's at every temperature (``check_reported_logprobs``).

Stop conditions live in the driver; the last test drives the backend through
``polyengine.driver.LLM.from_engine`` with token-id prompts and checks min_tokens,
ignore_eos, stop_token_ids and max_tokens end to end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from polyengine.errors import UnsupportedFeature
from polyengine.sampling import SamplingParams
from polyengine.sampling.params import ENGINE_FIELDS, MAX_TOP_LOGPROBS

from polyengine.conformance import layer
from polyengine.conformance.faults import FAULTS, ORDER
from polyengine.conformance.models import DEFAULT_MODEL, MODEL_NAMES, architecture_of, build_model, eos_prompt
from polyengine.conformance.layer_numerics import BIASED_TOKEN, DTYPES, check_reported_logprobs


@dataclass(frozen=True)
class Effect:
    """One way to see a parameter's effect: its setting, what else the check needs,
    the prompt (random, with repeats, or an EOS prompt), how many steps, and which
    realistic misimplementations (:data:`FAULTS`) the check also tells apart."""

    changes: dict[str, Any]
    base: dict[str, Any] = field(default_factory=dict)
    prompt: str = "random"
    steps: int = 8
    faults: tuple[str, ...] = ()
    seeds: int = 1  # requests with consecutive seeds, run side by side (at most max_slots)

    def label(self) -> str:
        def show(v: Any) -> str:
            if isinstance(v, dict) and len(v) > 3:
                head = ", ".join(f"{k}: {x!r}" for k, x in list(v.items())[:2])
                return f"{{{head}, ... ({len(v)} ids)}}"
            return repr(v)

        return ", ".join(f"{k}={show(v)}" for k, v in {**self.base, **self.changes}.items()) or "defaults"


# Symbolic token ids in a logit_bias or stop_token_ids, resolved on the default test
# model at run time: its two EOS ids and the last id of its vocabulary.
EOS, EOS2, LAST = "EOS", "EOS2", "LAST"
STOP = 23  # a stop token id (not an EOS id of any test model)

_BIASED = BIASED_TOKEN  # < every test model's vocabulary
_EVERY_THIRD = {t: 2.0 for t in range(0, 131, 3)}  # a third of the ids below every test vocabulary
# Every logit pushed below zero (the default model's vocabulary is 256): the repetition
# penalty then acts on negative logits, where dividing and multiplying part ways.
_ALL_NEGATIVE = {t: -10.0 for t in range(256)}
_GREEDY = {"temperature": 0.0}
_EOS_FAVOURED = {"logit_bias": {EOS: 30.0}}
_EOS2_FAVOURED = {"logit_bias": {EOS2: 30.0}}
_STOP_FAVOURED = {"stop_token_ids": (STOP,), "logit_bias": {STOP: 30.0}}
_PEN_AFTER_T = "penalties_after_temperature"
# Every check of a parameter that interacts with the temperature also runs sampled at
# temperatures other than 1 (0.5 sharpens, 1.7 flattens): an additive term applied
# after the temperature division, or a log-prob reported after it, is invisible at 1.
# A check names the realistic faults it exists to catch; the suite asserts on every
# run that each fault's streams differ from the correct ones (the check has power).
EFFECTS: dict[str, tuple[Effect, ...]] = {
    "temperature": (
        Effect({"temperature": 0.5}, faults=("temperature_ignored",)),
        Effect({"temperature": 1.7}, faults=("temperature_ignored",)),
    ),
    "top_k": (Effect({"top_k": 3}, faults=("top_k_keeps_one_more",)), Effect({"top_k": 3}, base={"temperature": 1.7})),
    "top_p": (Effect({"top_p": 0.5}), Effect({"top_p": 0.8}, base={"temperature": 0.5})),
    "min_p": (Effect({"min_p": 0.25}), Effect({"min_p": 0.1}, base={"temperature": 1.7}, faults=("min_p_before_temperature",))),
    "repetition_penalty": (
        Effect({"repetition_penalty": 3.0}, base=_GREEDY, prompt="repeats", steps=12, faults=("repetition_completion_only",)),
        Effect({"repetition_penalty": 1.5}, base={"temperature": 0.5}, prompt="repeats", steps=12),
        Effect({"repetition_penalty": 1.5}, base={**_GREEDY, "logit_bias": _ALL_NEGATIVE}, prompt="repeats", steps=12,
               faults=("repetition_divides_negative",)),
    ),
    "presence_penalty": (
        Effect({"presence_penalty": 2.0}, base=_GREEDY, steps=12, faults=("presence_counts_prompt",)),
        Effect({"presence_penalty": 2.0}, base={"temperature": 0.5}, steps=12, faults=(_PEN_AFTER_T,), seeds=4),
        Effect({"presence_penalty": -2.0}, base={"temperature": 1.7}, steps=12, faults=(_PEN_AFTER_T,), seeds=4),
    ),
    "frequency_penalty": (
        Effect({"frequency_penalty": 2.0}, base=_GREEDY, steps=12, faults=("frequency_counts_once",)),
        Effect({"frequency_penalty": 2.0}, base={"temperature": 0.5}, steps=12, faults=(_PEN_AFTER_T,), seeds=4),
        Effect({"frequency_penalty": -2.0}, base={"temperature": 1.7}, steps=12,
               faults=(_PEN_AFTER_T, "frequency_counts_once"), seeds=4),
    ),
    "logit_bias": (
        Effect({"logit_bias": {_BIASED: 10.0}}),
        Effect({"logit_bias": {_BIASED: 10.0}}, base=_GREEDY, faults=("greedy_ignores_processing",)),
        # the vocabulary's ends: id 0 (falsy) and the last id
        Effect({"logit_bias": {0: 8.0}}, base=_GREEDY, steps=4, faults=("bias_skips_token_zero",)),
        Effect({"logit_bias": {LAST: 8.0}}, base={"temperature": 0.5}, steps=4),
        Effect({"logit_bias": _EVERY_THIRD}, base={"temperature": 0.5}, faults=("bias_after_temperature",), seeds=4),
        Effect({"logit_bias": _EVERY_THIRD}, base={"temperature": 1.7}, faults=("bias_after_temperature",), seeds=4),
    ),
    "min_tokens": (
        Effect({"min_tokens": 3}, base=_GREEDY, prompt="eos", steps=5),
        # EOS is the greedy first token of the EOS prompt: min_tokens=1 holds it off for
        # exactly one token.
        Effect({"min_tokens": 1}, base=_GREEDY, prompt="eos", steps=3, faults=("min_tokens_off_by_one",)),
        # Sampled, EOS made the overwhelming favourite by a bias: the first token cannot
        # be EOS, the second (almost surely) is.
        Effect({"min_tokens": 1}, base={"temperature": 0.7, **_EOS_FAVOURED}, steps=3, faults=("min_tokens_off_by_one",)),
        Effect({"min_tokens": 3}, base={"temperature": 1.7, **_EOS_FAVOURED}, steps=5, faults=("min_tokens_off_by_one",)),
        # the model's second EOS id, and a stop token id, favoured the same way
        Effect({"min_tokens": 3}, base={"temperature": 0.7, **_EOS2_FAVOURED}, steps=5, faults=("eos_masks_first_eos_only",)),
        Effect({"min_tokens": 3}, base={"temperature": 0.7, **_STOP_FAVOURED}, steps=5, faults=("min_tokens_ignores_stop_ids",)),
    ),
    "ignore_eos": (
        Effect({"ignore_eos": True}, base=_GREEDY, prompt="eos", steps=5),
        Effect({"ignore_eos": True}, base={"temperature": 0.7, **_EOS_FAVOURED}, steps=5),
        Effect({"ignore_eos": True}, base=_GREEDY, prompt="eos2", steps=5, faults=("eos_masks_first_eos_only",)),
        # ignore_eos masks the EOS ids only: a favoured stop token id is still drawn
        Effect({"ignore_eos": True}, base={"temperature": 0.7, **_STOP_FAVOURED, "logit_bias": {STOP: 30.0, EOS: 45.0}},
               steps=5, faults=("ignore_eos_masks_stop_ids",)),
    ),
    "logprobs": tuple(Effect({"logprobs": True}, base=b) for b in ({}, {"temperature": 0.5}, {"temperature": 1.7})),
    "top_logprobs": tuple(
        Effect({"logprobs": True, "top_logprobs": 3}, base=b) for b in ({}, {"temperature": 0.5}, {"temperature": 1.7})
    ),
    "seed": (Effect({}),),
}
assert set(EFFECTS) == ENGINE_FIELDS, "every engine-side field needs an effect check"
assert all(f in FAULTS for effects in EFFECTS.values() for e in effects for f in e.faults)


def _resolve(settings: dict[str, Any], model) -> dict[str, Any]:
    """Symbolic ids (EOS, EOS2, LAST) replaced by the model's."""
    eos = model.eos_token_ids
    names = {EOS: eos[0], EOS2: eos[1], LAST: model.config.vocab_size - 1}
    out = dict(settings)
    if "logit_bias" in out:
        out["logit_bias"] = {names.get(k, k): v for k, v in out["logit_bias"].items()}
    return out


def _prompt(conformance, kind: str, salt: int) -> list[int]:
    if kind in ("eos", "eos2"):
        return eos_prompt(build_model(DEFAULT_MODEL), 0 if kind == "eos" else 1)
    if kind == "repeats":  # every token three times: plenty for a repetition penalty to act on
        return conformance.prompt(6, salt) * 3
    return conformance.prompt(7, salt)


def _refused(conformance, name: str, sampling: SamplingParams, what: str) -> None:
    """prefill with ``sampling`` must raise UnsupportedFeature and leave a running slot as it was."""
    eng = conformance.engine()
    prompt_a, s_a = conformance.prompt(6, 401), conformance.sampling(401)
    want = conformance.driver(eng).run(0, prompt_a, s_a, 6)
    d = conformance.driver(eng)
    d.insert(0, prompt_a, s_a)
    d.step(n=2)
    try:
        eng.prefill(params=d.params, tokens=conformance.prompt(5, 402), sampling=sampling)
    except UnsupportedFeature:
        pass
    except Exception as exc:
        raise AssertionError(f"prefill with {what} raised {type(exc).__name__} ({exc}); an undeclared feature must raise UnsupportedFeature") from None
    else:
        raise AssertionError(
            f"prefill accepted {what}, which the backend does not declare ({name} is not in Capabilities."
            f"sampling_params): an undeclared parameter must raise UnsupportedFeature, never be silently ignored"
        )
    while len(d.tokens[0]) < 6:
        d.step()
    div = conformance.compare_pair(d.tokens[0][:6], want, prompt_a, s_a, what="slot 0 around a refused prefill")
    assert div is None or div.near_tie, f"a refused prefill changed a running slot's tokens (token #{div.step}): refusals must come before any work"


@layer("honesty")
class HonestyLayer:
    @pytest.mark.parametrize("name", sorted(ENGINE_FIELDS))
    def test_sampling_parameter(self, conformance, name):
        """The parameter has its specified effect, greedy or at temperature 1 and sampled
        at other temperatures (the stream equals the reference's under the same seed),
        or prefill refuses it (UnsupportedFeature)."""
        effects = EFFECTS[name]
        model = build_model(DEFAULT_MODEL)
        if name != "seed" and not conformance.declares(name):
            changes = _resolve(effects[0].changes, model)
            _refused(conformance, name, conformance.sampling(411, **changes), f"{name}={changes.get(name)!r}")
            return
        eng = conformance.engine()
        ran: list[Effect] = []
        for effect in effects:
            settings = _resolve({**effect.base, **effect.changes}, model)
            needs = [k for k in settings if k != name and k in ENGINE_FIELDS and not conformance.declares(k)]
            if needs:
                conformance.note(f"{name} checked without the case {effect.label()}: it needs {', '.join(needs)}, which is not declared")
                continue
            sampling = conformance.sampling(411, **settings)
            prompt = _prompt(conformance, effect.prompt, 411)
            if name in ("logprobs", "top_logprobs"):
                self._check_logprobs(conformance, eng, prompt, sampling)
            else:
                self._check_effect(conformance, eng, name, effect, prompt, sampling, ran, model)
            ran.append(effect)
        if not ran:
            pytest.skip(f"{name} is declared but each of its checks also needs a parameter that is not")

    @staticmethod
    def _check_effect(conformance, eng, name, effect, prompt, sampling, ran, model):
        oracle = conformance.oracle()
        what = f"{name}: {effect.label()}"
        n = min(effect.seeds, eng.max_concurrent_decodes)
        variants = [sampling.model_copy(update={"seed": sampling.seed + i}) for i in range(n)]
        stream = lambda sp: [x.token for x in oracle.stream(prompt, sp, effect.steps)]  # noqa: E731
        if name == "seed":  # the effect of a seed: another seed draws another stream
            variants.append(conformance.sampling(412))
            without = [None] * len(variants)
        else:
            neutral = SamplingParams.model_fields[name].get_default(call_default_factory=True)
            want = [stream(sp) for sp in variants]
            without = [stream(sp.model_copy(update={name: neutral})) for sp in variants]
            assert want != without, f"suite bug: the {name} check ({effect.label()}) has no power ({want} either way)"
        faulty: dict[str, list[list[int]]] = {}
        for fault in effect.faults:
            faulty[fault] = [[x.token for x in oracle.stream(prompt, sp, effect.steps, fault=FAULTS[fault])] for sp in variants]
            assert faulty[fault] != want, (
                f"suite bug: the {name} check ({effect.label()}) cannot tell {fault} apart ({want} either way)"
            )
        d = conformance.driver(eng)
        for slot, sp in enumerate(variants):
            d.insert(slot, prompt, sp)
        while min(len(d.tokens[slot]) for slot in range(len(variants))) < effect.steps:
            d.step()
        got = [d.tokens[slot][: effect.steps] for slot in range(len(variants))]
        masked = set(model.eos_token_ids)
        named = next((f"; {FAULTS[f].message}" for f, streams in faulty.items() if got == streams), "")
        for i, sp in enumerate(variants):
            if name == "min_tokens":
                early = [(j, t) for j, t in enumerate(got[i][: sp.min_tokens]) if t in masked | set(sp.stop_token_ids)]
                assert not early, (
                    f"{what}, seed {sp.seed}: the backend drew {early[0][1]} (an EOS or stop token id) as completion "
                    f"token #{early[0][0]} (tokens {got[i]}) although min_tokens={sp.min_tokens}: EOS was let through "
                    f"early; every EOS id and the request's stop token ids must be masked while the completion is "
                    f"shorter than min_tokens (step < min_tokens; masking only while step < min_tokens - 1 is an "
                    f"off-by-one){named}"
                )
            div = conformance.compare_to_oracle(got[i], prompt, sp, what=f"{what}, seed {sp.seed}")
            if div is None or div.near_tie:
                continue
            for fault, streams in faulty.items():
                if got == streams:
                    raise AssertionError(
                        f"{what}: {FAULTS[fault].message}; seed {sp.seed}: reference {want[i]}, backend {got[i]}"
                    )
            if without[i] is not None and got == without:
                raise AssertionError(
                    f"{name}={getattr(sp, name)!r} is declared but ignored ({what}): the tokens {got} are exactly "
                    f"those drawn without it"
                )
            hint = ""
            t = sp.temperature
            if t not in (0.0, 1.0) and any(e.base.get("temperature", 1.0) in (0.0, 1.0) for e in ran):
                hint = (
                    f"; {name} has its effect greedy/at temperature 1 but not at temperature {t:g}: it is applied at the "
                    f"wrong point relative to the temperature division ({ORDER})"
                )
            raise AssertionError(
                f"{name} does not have its specified effect ({what}), seed {sp.seed}: {div.describe()}{hint}"
            )

    @staticmethod
    def _check_logprobs(conformance, eng, prompt, sampling):
        d = conformance.driver(eng)
        tokens = d.run(0, prompt, sampling, 4)
        k = sampling.top_logprobs
        check_reported_logprobs(
            conformance, model=DEFAULT_MODEL, dtype=conformance.dtype, prompt=prompt, sampling=sampling,
            tokens=tokens, logprobs=d.logprobs[0], tops=d.top[0], k=k,
            what=f"{sampling.model_dump(exclude_defaults=True, exclude={'seed'})}",
        )

    def test_top_logprobs_limit(self, conformance):
        """top_logprobs up to max_top_logprobs works; one more raises UnsupportedFeature."""
        caps = conformance.capabilities
        eng = conformance.engine()
        d = conformance.driver(eng)
        m = caps.max_top_logprobs
        if m < MAX_TOP_LOGPROBS:
            over = SamplingParams(temperature=1.0, seed=421, logprobs=True, top_logprobs=m + 1)  # not capped: the refusal is the point
            with pytest.raises(UnsupportedFeature):
                eng.prefill(params=d.params, tokens=[3, 4, 5], sampling=over)
        if m > 0 and conformance.declares("logprobs") and conformance.declares("top_logprobs"):
            d.run(0, [3, 4, 5], conformance.sampling(421, logprobs=True, top_logprobs=m), 2)
            assert all((ids[:m] >= 0).all() and len(ids) >= m for ids, _ in d.top[0][:2]), (
                f"top_logprobs={m} (= max_top_logprobs) did not return {m} ids per token"
            )

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_dtype(self, conformance, dtype):
        """A declared dtype builds and runs; an undeclared one is refused with UnsupportedFeature."""
        harness = conformance.harness
        if dtype in conformance.capabilities.dtypes:
            eng = conformance.engine(DEFAULT_MODEL, dtype)
            conformance.driver(eng).run(0, [3, 4, 5], conformance.sampling(431), 2)
            return
        try:
            harness.build(build_model(DEFAULT_MODEL), harness.config(dtype))
        except UnsupportedFeature:
            return
        except Exception as exc:
            raise AssertionError(f"building an engine with undeclared dtype {dtype} raised {type(exc).__name__} ({exc}); expected UnsupportedFeature") from None
        raise AssertionError(
            f"the factory built an engine with dtype {dtype}, which Capabilities.dtypes {list(conformance.capabilities.dtypes)} "
            f"does not declare: declare it or raise UnsupportedFeature"
        )

    @pytest.mark.parametrize("model", MODEL_NAMES)
    def test_architecture(self, conformance, model):
        """A test model of an undeclared architecture (Capabilities.architectures) is refused
        with UnsupportedFeature when the engine is built (a declared one runs in the
        numerics layer)."""
        arch = architecture_of(model)
        if arch in conformance.capabilities.architectures:
            pytest.skip(f"architecture {arch!r} is declared: the numerics layer runs model {model}")
        harness = conformance.harness
        try:
            harness.build(build_model(model), harness.config(None))
        except UnsupportedFeature:
            return
        except Exception as exc:
            raise AssertionError(f"building an engine for model {model} (architecture {arch!r}, not declared) raised "
                                 f"{type(exc).__name__} ({exc}); expected UnsupportedFeature") from None
        raise AssertionError(
            f"the factory built an engine for architecture {arch!r}, which Capabilities.architectures "
            f"{list(conformance.capabilities.architectures)} does not declare: declare it (and pass the numerics "
            f"layer on it) or raise UnsupportedFeature")

    def test_driver_stop_conditions(self, conformance):
        """Through LLM.from_engine: either EOS id stops, min_tokens holds EOS and the stop
        token ids off (alone and together), ignore_eos ignores every EOS id,
        stop_token_ids and max_tokens stop where the reference's stream says."""
        from polyengine.driver import LLM

        conformance.require_params("temperature")
        eng = conformance.engine()
        llm = LLM.from_engine(eng, tools=False)
        model = build_model(DEFAULT_MODEL)
        eos_ids = tuple(model.eos_token_ids)
        oracle = conformance.oracle()

        def run(prompt, **kw):
            out = llm.generate([prompt], SamplingParams(temperature=0.0, seed=0, **kw))[0].outputs[0]
            return out.token_ids, out.finish_reason

        for which, eos in enumerate(eos_ids):
            tokens, reason = run(eos_prompt(model, which), max_tokens=6)
            assert (tokens, reason) == ([eos], "stop"), (
                f"greedy on the prompt of EOS id #{which} gave {tokens} ({reason}), expected [{eos}] (stop): the driver "
                f"stops on every id in engine.eos_token_ids"
            )
        ep = eos_prompt(model)
        free = conformance.prompt(7, 441)
        stream = [x.token for x in oracle.stream(free, SamplingParams(temperature=0.0, seed=0), 6)]
        stop_at = next((t for i, t in enumerate(stream) if i >= 2 and t not in stream[:i] and t not in eos_ids), None)
        cases = []
        if conformance.declares("min_tokens"):
            cases.append(("min_tokens=3", ep, dict(min_tokens=3, max_tokens=8)))
            cases.append(("min_tokens=1", ep, dict(min_tokens=1, max_tokens=4)))  # EOS is the greedy first token
            if stop_at is not None:
                # the stop token would end it at stream.index(stop_at) + 1 tokens; min_tokens holds it off
                cases.append((f"min_tokens with stop_token_ids=[{stop_at}]", free,
                              dict(min_tokens=stream.index(stop_at) + 2, stop_token_ids=(stop_at,), max_tokens=8)))
        if conformance.declares("ignore_eos"):
            cases.append(("ignore_eos", ep, dict(ignore_eos=True, max_tokens=6)))
            cases.append(("ignore_eos (second EOS id)", eos_prompt(model, 1), dict(ignore_eos=True, max_tokens=6)))
        if stop_at is not None:
            cases.append((f"stop_token_ids=[{stop_at}]", free, dict(stop_token_ids=(stop_at,), max_tokens=6)))
        cases.append(("max_tokens=4", free, dict(max_tokens=4)))
        for what, prompt, kw in cases:
            tokens, reason = run(prompt, **kw)
            sp = SamplingParams(temperature=0.0, seed=0, **kw)
            want = [x.token for x in oracle.stream(prompt, sp, kw["max_tokens"])]
            want_tokens, want_reason = _driver_cut(want, sp, eos_ids)
            if (tokens, reason) == (want_tokens, want_reason):
                continue
            div = conformance.compare_to_oracle(tokens, prompt, sp, what=f"driver, {what}")
            if div is not None and div.near_tie:
                continue
            raise AssertionError(f"through the driver with {what}: got {tokens} ({reason}), expected {want_tokens} ({want_reason})")


def _driver_cut(stream: list[int], sp: SamplingParams, eos_ids: tuple[int, ...]) -> tuple[list[int], str]:
    """Where the driver must stop the reference's stream (see driver/scheduler.py)."""
    for i, tok in enumerate(stream):
        n = i + 1
        if n >= sp.min_tokens and ((tok in eos_ids and not sp.ignore_eos) or tok in sp.stop_token_ids):
            return stream[:n], "stop"
        if sp.max_tokens is not None and n >= sp.max_tokens:
            return stream[:n], "length"
    return stream, "length"
