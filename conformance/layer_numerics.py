"""Layer 3, numerics: logits, log-probs and greedy tokens against the reference.

Every test model (one per architecture, and the quantized ones: conformance/models.py)
in every declared dtype (dtypes and architectures a backend does not declare are skipped here, counted
apart, and their refusal is tested in the honesty layer). The
reference is the float64 NumPy backend; errors are measured per logits row as
relative L2 and per log-prob as absolute error, against the tolerances in force
(recorded in the report with their source).

Reported log-probs are the raw model's (docs/design.md, "Sampling"): the decode
check samples at temperature 0.5 with a logit_bias and a presence penalty, so a
backend that reports the log-probs of its processed distribution fails, and
:func:`check_reported_logprobs` (shared with the honesty layer) names the stage
whose log-probs it reports instead.

Greedy tokens must equal the reference's for every step, except that the streams
may part where the reference's top-1/top-2 margin is below ``tie_gap``: such a
divergence is reported (a note in the report and the terminal summary), not failed.
"""

from __future__ import annotations

import numpy as np
import pytest

from polyengine.sampling import RowState, SamplingParams, process_logits, raw_logprobs

from polyengine.conformance import layer
from polyengine.conformance.harness import LIMITS
from polyengine.conformance.models import ALL_MODEL_NAMES
from polyengine.conformance.stats import rel_l2

# The dtypes the suite has default tolerances for (tolerances.toml).
DTYPES = ("float64", "float32", "bfloat16", "float16")
PREFILL_LENGTHS = (1, 7, 16, LIMITS["max_prefill_length"])
GREEDY_STEPS = 16
LOGPROB_STEPS = 8

BIASED_TOKEN = 99  # a token id below every test model's vocabulary size


def _processed_logprobs(logits: np.ndarray, row: RowState, eos) -> dict[str, np.ndarray]:
    """The log-probs a backend might report by mistake: those of the processed logits
    at each stage of the sampler (polyengine.sampling.PIPELINE), by description."""
    p = row.params
    unfiltered = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
    out: dict[str, np.ndarray] = {}
    t = p.temperature or 1.0
    if t != 1.0:
        out["log-softmax(logits / temperature), the temperature-scaled distribution"] = raw_logprobs(
            np.asarray(logits, np.float64) / t)
    if (p.logit_bias or p.min_tokens or p.ignore_eos or p.repetition_penalty != 1.0 or p.presence_penalty
            or p.frequency_penalty):
        out["the log-softmax after logit_bias/penalties"] = raw_logprobs(
            process_logits(logits, RowState(p.model_copy(update={"temperature": 0.0}), row.sample_index, row.step,
                                            row.prompt_tokens, row.completion_tokens), eos))
        if t != 1.0:
            out["the log-softmax after logit_bias, penalties and temperature"] = process_logits(
                logits, RowState(p.model_copy(update={**unfiltered, "temperature": t}), row.sample_index, row.step,
                                 row.prompt_tokens, row.completion_tokens), eos)
    if p.temperature and (p.top_k or p.top_p < 1.0 or p.min_p):
        out["the filtered distribution the token is drawn from"] = process_logits(logits, row, eos)
    return out


def check_reported_logprobs(conformance, *, model, dtype, prompt, sampling, tokens, logprobs, tops, k, what) -> None:
    """Reported log-probs (``ResultTokens.logprobs``, and ``top_ids``/``top_logprobs`` when
    ``k``) are the raw model's for each context the backend's own tokens make: the
    reference's log-softmax of the logits before any processing, within ``logprob_abs``.

    A value that is off is compared with the log-probs of each processing stage, so the
    message can say which distribution the backend reports instead.
    """
    steps = len(tokens)
    assert len(logprobs) >= steps and (not k or len(tops) >= steps), (
        f"{what}: logprobs=True, top_logprobs={k}: got {len(logprobs)} log-probs and {len(tops)} top lists for "
        f"{steps} tokens (ResultTokens.logprobs/top_ids/top_logprobs must be filled)"
    )
    oracle = conformance.oracle(model)
    tol = conformance.tolerance("logprob_abs", dtype, model).value
    worst, where = 0.0, "no error"
    for step in range(steps):
        ctx = list(prompt) + list(tokens[:step])
        want = oracle.raw_logprobs(ctx)
        tok = int(tokens[step])
        ids = np.array([tok])
        vals = np.array([logprobs[step]], np.float64)
        if k:
            top_ids = np.asarray(tops[step][0])[:k]
            assert (top_ids >= 0).all() and len(set(top_ids.tolist())) == k, (
                f"{what}, step {step}: top_ids {top_ids.tolist()} are not {k} distinct ids"
            )
            top_vals = np.asarray(tops[step][1], np.float64)[:k]
            ids, vals = np.concatenate([ids, top_ids]), np.concatenate([vals, top_vals])
        err = float(np.max(np.abs(vals - want[ids])))
        if err > worst:
            worst, where = err, f"{what}, step {step}"
        if not err <= tol:
            conformance.measure("logprob_abs", err, dtype, model, where=where)
            row = RowState(sampling, 0, step, np.array(prompt), np.array(tokens[:step], np.int64))
            seen = ""
            for name, cand in _processed_logprobs(oracle.logits(ctx), row, oracle.eos_token_ids).items():
                if float(np.max(np.abs(vals - cand[ids]))) <= max(tol, 1e-5):
                    seen = f"; they equal {name}"
                    break
            bad = int(np.argmax(np.abs(vals - want[ids])))
            raise AssertionError(
                f"{what}, step {step}: reported log-probs are not the raw model's (the log-softmax of the logits "
                f"before logit_bias, penalties and temperature): token {int(ids[bad])} "
                f"reported {vals[bad]:.5f}, the raw log-prob is {want[ids[bad]]:.5f} (|error| {err:.3g} > logprob_abs "
                f"{tol:g}){seen}"
            )
        if k:
            kth = np.sort(want)[-k]
            outsiders = [int(i) for i in top_ids if want[i] < kth - 2 * tol]
            assert not outsiders, (
                f"{what}, step {step}: top_ids {top_ids.tolist()} include {outsiders}, which are not among the raw "
                f"model's top {k} (reference top ids {np.argsort(-want, kind='stable')[:k].tolist()}): top_logprobs "
                f"must rank the raw log-probs, before logit_bias, penalties and temperature"
            )
            assert np.all(np.diff(top_vals) <= 2 * tol), (
                f"{what}, step {step}: top_logprobs {top_vals.tolist()} are not in descending order"
            )
    conformance.within("logprob_abs", worst, dtype, model, what=f"{where}: reported log-probs vs the reference")


# Stacked parametrize: the decorator nearest the function gives the first id part,
# so ids read test_x[model-dtype].
_by_model_and_dtype = (pytest.mark.parametrize("dtype", DTYPES), pytest.mark.parametrize("model", ALL_MODEL_NAMES))


def _param(fn):
    for mark in reversed(_by_model_and_dtype):
        fn = mark(fn)
    return fn


@layer("numerics")
class NumericsLayer:
    @_param
    def test_prefill_logits_match_reference(self, conformance, model, dtype):
        """Prefix.host_logits() within logits_rel_l2 of the reference, several prompt lengths."""
        conformance.require_dtype(dtype)
        conformance.require_architecture(model)
        eng = conformance.engine(model, dtype)
        d = conformance.driver(eng)
        oracle = conformance.oracle(model)
        for length in PREFILL_LENGTHS:
            prompt = conformance.prompt(length, 101, model)
            prefix, _ = d.prefill(prompt, conformance.sampling(101))
            got = prefix.host_logits()
            assert got.shape == (eng.vocab_size,), f"host_logits() has shape {got.shape}, expected ({eng.vocab_size},)"
            conformance.within(
                "logits_rel_l2", rel_l2(got, oracle.logits(prompt)), dtype, model,
                what=f"model {model}, {dtype}, prompt length {length}: prefill logits vs the reference",
            )

    @_param
    def test_decode_logprobs_match_reference(self, conformance, model, dtype):
        """Each step's reported log-prob and top log-probs are the raw model's (log-softmax
        of the logits before logit_bias, penalties and temperature), within logprob_abs of
        the reference's for the same context, while sampling at temperature 0.5 with a
        logit_bias and a presence penalty (those the backend declares); the top ids are the
        reference's raw top ids up to ties within the tolerance."""
        conformance.require_dtype(dtype)
        conformance.require_architecture(model)
        conformance.require_params("logprobs", "top_logprobs")
        eng = conformance.engine(model, dtype)
        k = min(5, eng.capabilities.max_top_logprobs)
        prompt = conformance.prompt(9, 111, model)
        processing = {"temperature": 0.5, "logit_bias": {BIASED_TOKEN: 3.0}, "presence_penalty": 1.0}
        sampling = conformance.sampling(
            111, logprobs=True, top_logprobs=k, **{n: v for n, v in processing.items() if conformance.declares(n)}
        )
        d = conformance.driver(eng)
        tokens = d.run(0, prompt, sampling, LOGPROB_STEPS)
        check_reported_logprobs(
            conformance, model=model, dtype=dtype, prompt=prompt, sampling=sampling, tokens=tokens,
            logprobs=d.logprobs[0], tops=d.top[0], k=k,
            what=f"model {model}, {dtype}, {sampling.model_dump(exclude_defaults=True, exclude={'seed'})}",
        )

    @_param
    def test_greedy_matches_reference(self, conformance, model, dtype):
        """Greedy tokens equal the reference's for GREEDY_STEPS steps from two prompts;
        a divergence is allowed only at a near tie (reported)."""
        conformance.require_dtype(dtype)
        conformance.require_architecture(model)
        conformance.require_params("temperature")
        eng = conformance.engine(model, dtype)
        greedy = SamplingParams(temperature=0.0, seed=0)
        for salt, length in ((121, 5), (122, 14)):
            prompt = conformance.prompt(length, salt, model)
            got = conformance.driver(eng).run(0, prompt, greedy, GREEDY_STEPS)
            div = conformance.compare_to_oracle(
                got, prompt, greedy, model=model, dtype=dtype,
                what=f"greedy, model {model}, {dtype}, prompt length {length}",
            )
            assert div is None or div.near_tie, (
                f"model {model}, {dtype}, prompt length {length}: greedy {div.describe()}, not a near tie "
                f"(tie_gap {conformance.tolerance('tie_gap', dtype, model).value:g}); tokens so far {got[:div.step]}"
            )
