"""Layer 5, parameter honesty: every parameter does what it says or is refused.

For each engine-side sampling parameter (``polyengine.sampling.params.ENGINE_FIELDS``):
declared in ``Capabilities.sampling_params``, it must have its specified effect (the
backend's stream equals the reference's with the parameter, and the suite checks
that the reference's stream without it differs, so the check has power); undeclared,
``prefill`` must raise ``UnsupportedFeature`` before any work, leaving running slots
untouched. Likewise for ``top_logprobs`` beyond ``max_top_logprobs`` and for dtypes
the backend does not declare. Refusals are tested, never skipped.

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
from polyengine.conformance.models import DEFAULT_MODEL, build_model, eos_prompt
from polyengine.conformance.layer_numerics import DTYPES


@dataclass(frozen=True)
class Effect:
    """How to see one parameter's effect: its setting, what else the check needs,
    the prompt (random, with repeats, or the EOS prompt) and how many steps."""

    changes: dict[str, Any]
    base: dict[str, Any] = field(default_factory=dict)
    prompt: str = "random"
    steps: int = 8


_BIASED = 99  # < every test model's vocabulary
EFFECTS = {
    "temperature": Effect({"temperature": 0.5}),
    "top_k": Effect({"top_k": 3}),
    "top_p": Effect({"top_p": 0.5}),
    "min_p": Effect({"min_p": 0.25}),
    "repetition_penalty": Effect({"repetition_penalty": 3.0}, base={"temperature": 0.0}, prompt="repeats", steps=12),
    "presence_penalty": Effect({"presence_penalty": 2.0}, base={"temperature": 0.0}, steps=12),
    "frequency_penalty": Effect({"frequency_penalty": 2.0}, base={"temperature": 0.0}, steps=12),
    "logit_bias": Effect({"logit_bias": {_BIASED: 10.0}}),
    "min_tokens": Effect({"min_tokens": 3}, base={"temperature": 0.0}, prompt="eos", steps=5),
    "ignore_eos": Effect({"ignore_eos": True}, base={"temperature": 0.0}, prompt="eos", steps=5),
    "logprobs": Effect({"logprobs": True}),
    "top_logprobs": Effect({"logprobs": True, "top_logprobs": 3}),
    "seed": Effect({}),
}
assert set(EFFECTS) == ENGINE_FIELDS, "every engine-side field needs an effect check"


def _prompt(conformance, kind: str, salt: int) -> list[int]:
    if kind == "eos":
        return eos_prompt(build_model(DEFAULT_MODEL))
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
        """The parameter has its specified effect, or prefill refuses it (UnsupportedFeature)."""
        effect = EFFECTS[name]
        sampling = conformance.sampling(411, **effect.base, **effect.changes)
        if name != "seed" and not conformance.declares(name):
            _refused(conformance, name, conformance.sampling(411, **effect.changes), f"{name}={getattr(sampling, name)!r}")
            return
        needs = [k for k in {**effect.base, **effect.changes} if k != name and not conformance.declares(k)]
        if needs:
            pytest.skip(f"{name} is declared but its check also needs {', '.join(needs)}, which is not")
        eng = conformance.engine()
        prompt = _prompt(conformance, effect.prompt, 411)
        if name in ("logprobs", "top_logprobs"):
            self._check_logprobs(conformance, eng, prompt, sampling)
            return
        oracle = conformance.oracle()
        variants = [sampling]
        if name == "seed":  # the effect of a seed: another seed draws another stream
            variants.append(conformance.sampling(412))
            without = None
        else:
            neutral = SamplingParams.model_fields[name].get_default(call_default_factory=True)
            without = [x.token for x in oracle.stream(prompt, sampling.model_copy(update={name: neutral}), effect.steps)]
            with_ = [x.token for x in oracle.stream(prompt, sampling, effect.steps)]
            assert with_ != without, f"suite bug: the {name} check has no power ({with_} either way)"
        for sp in variants:
            got = conformance.driver(eng).run(1, prompt, sp, effect.steps)
            div = conformance.compare_to_oracle(got, prompt, sp, what=f"{name}: {sp.model_dump(exclude_defaults=True)}")
            if div is None or div.near_tie:
                continue
            if without is not None and got == without:
                raise AssertionError(
                    f"{name}={getattr(sp, name)!r} is declared but ignored: the tokens {got} are exactly those "
                    f"drawn without it"
                )
            raise AssertionError(f"{name}={getattr(sp, name)!r} does not have its specified effect: {div.describe()}")

    @staticmethod
    def _check_logprobs(conformance, eng, prompt, sampling):
        d = conformance.driver(eng)
        tokens = d.run(0, prompt, sampling, 4)
        assert len(d.logprobs[0]) >= 4, "logprobs=True but ResultTokens.logprobs is missing"
        oracle = conformance.oracle()
        worst = max(abs(d.logprobs[0][i] - oracle.raw_logprobs(prompt + tokens[:i])[tokens[i]]) for i in range(4))
        conformance.within("logprob_abs", worst, conformance.dtype, DEFAULT_MODEL, what="reported log-probs vs the reference")
        k = sampling.top_logprobs
        if k:
            assert len(d.top[0]) >= 4 and all((ids[:k] >= 0).all() for ids, _ in d.top[0][:4]), (
                f"top_logprobs={k} but ResultTokens.top_ids does not hold {k} ids per token"
            )

    def test_top_logprobs_limit(self, conformance):
        """top_logprobs up to max_top_logprobs works; one more raises UnsupportedFeature."""
        caps = conformance.capabilities
        eng = conformance.engine()
        d = conformance.driver(eng)
        m = caps.max_top_logprobs
        if m < MAX_TOP_LOGPROBS:
            with pytest.raises(UnsupportedFeature):
                eng.prefill(params=d.params, tokens=[3, 4, 5], sampling=conformance.sampling(421, logprobs=True, top_logprobs=m + 1))
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

    def test_driver_stop_conditions(self, conformance):
        """Through LLM.from_engine: EOS stops, min_tokens holds it off, ignore_eos ignores
        it, stop_token_ids and max_tokens stop where the reference's stream says."""
        from polyengine.driver import LLM

        conformance.require_params("temperature")
        eng = conformance.engine()
        llm = LLM.from_engine(eng, tools=False)
        model = build_model(DEFAULT_MODEL)
        eos = model.eos_token_ids[0]
        oracle = conformance.oracle()
        ep = eos_prompt(model)

        def run(prompt, **kw):
            out = llm.generate([prompt], SamplingParams(temperature=0.0, seed=0, **kw))[0].outputs[0]
            return out.token_ids, out.finish_reason

        tokens, reason = run(ep, max_tokens=6)
        assert (tokens, reason) == ([eos], "stop"), f"greedy on the EOS prompt gave {tokens} ({reason}), expected [EOS={eos}] (stop)"
        cases = []
        if conformance.declares("min_tokens"):
            cases.append(("min_tokens=3", ep, dict(min_tokens=3, max_tokens=8)))
        if conformance.declares("ignore_eos"):
            cases.append(("ignore_eos", ep, dict(ignore_eos=True, max_tokens=6)))
        free = conformance.prompt(7, 441)
        stream = [x.token for x in oracle.stream(free, SamplingParams(temperature=0.0, seed=0), 6)]
        stop_at = next((t for i, t in enumerate(stream) if i >= 2 and t not in stream[:i] and t != eos), None)
        if stop_at is not None:
            cases.append((f"stop_token_ids=[{stop_at}]", free, dict(stop_token_ids=(stop_at,), max_tokens=6)))
        cases.append(("max_tokens=4", free, dict(max_tokens=4)))
        for what, prompt, kw in cases:
            tokens, reason = run(prompt, **kw)
            sp = SamplingParams(temperature=0.0, seed=0, **kw)
            want = [x.token for x in oracle.stream(prompt, sp, kw["max_tokens"])]
            want_tokens, want_reason = _driver_cut(want, sp, eos)
            if (tokens, reason) == (want_tokens, want_reason):
                continue
            div = conformance.compare_to_oracle(tokens, prompt, sp, what=f"driver, {what}")
            if div is not None and div.near_tie:
                continue
            raise AssertionError(f"through the driver with {what}: got {tokens} ({reason}), expected {want_tokens} ({want_reason})")


def _driver_cut(stream: list[int], sp: SamplingParams, eos: int) -> tuple[list[int], str]:
    """Where the driver must stop the reference's stream (see driver/scheduler.py)."""
    for i, tok in enumerate(stream):
        n = i + 1
        if n >= sp.min_tokens and ((tok == eos and not sp.ignore_eos) or tok in sp.stop_token_ids):
            return stream[:n], "stop"
        if sp.max_tokens is not None and n >= sp.max_tokens:
            return stream[:n], "length"
    return stream, "length"
