"""Layer 3, numerics: logits, log-probs and greedy tokens against the reference.

Every test model in every declared dtype (dtypes a backend does not declare are
skipped here, counted apart, and their refusal is tested in the honesty layer). The
reference is the float64 NumPy backend; errors are measured per logits row as
relative L2 and per log-prob as absolute error, against the tolerances in force
(recorded in the report with their source).

Greedy tokens must equal the reference's for every step, except that the streams
may part where the reference's top-1/top-2 margin is below ``tie_gap``: such a
divergence is reported (a note in the report and the terminal summary), not failed.
"""

from __future__ import annotations

import numpy as np
import pytest

from polyengine.sampling import SamplingParams

from polyengine.conformance import layer
from polyengine.conformance.harness import LIMITS
from polyengine.conformance.models import MODEL_NAMES
from polyengine.conformance.stats import rel_l2

# The dtypes the suite has default tolerances for (tolerances.toml).
DTYPES = ("float64", "float32", "bfloat16", "float16")
PREFILL_LENGTHS = (1, 7, 16, LIMITS["max_prefill_length"])
GREEDY_STEPS = 16
LOGPROB_STEPS = 8

# Stacked parametrize: the decorator nearest the function gives the first id part,
# so ids read test_x[model-dtype].
_by_model_and_dtype = (pytest.mark.parametrize("dtype", DTYPES), pytest.mark.parametrize("model", MODEL_NAMES))


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
        """Each step's reported log-prob and top log-probs (raw model log-softmax) within
        logprob_abs of the reference's for the same context; the top ids are the
        reference's top ids up to ties within the tolerance."""
        conformance.require_dtype(dtype)
        conformance.require_params("logprobs", "top_logprobs")
        eng = conformance.engine(model, dtype)
        k = min(5, eng.capabilities.max_top_logprobs)
        oracle = conformance.oracle(model)
        prompt = conformance.prompt(9, 111, model)
        sampling = conformance.sampling(111, logprobs=True, top_logprobs=k)
        d = conformance.driver(eng)
        tokens = d.run(0, prompt, sampling, LOGPROB_STEPS)
        lps, tops = d.logprobs[0], d.top[0]
        assert len(lps) >= LOGPROB_STEPS and len(tops) >= LOGPROB_STEPS, (
            f"logprobs=True, top_logprobs={k}: got {len(lps)} log-probs and {len(tops)} top lists for "
            f"{LOGPROB_STEPS} tokens (ResultTokens.logprobs/top_ids/top_logprobs must be filled)"
        )
        tol = conformance.tolerance("logprob_abs", dtype, model).value
        worst = 0.0
        for step in range(LOGPROB_STEPS):
            want = oracle.raw_logprobs(prompt + tokens[:step])
            worst = max(worst, abs(lps[step] - want[tokens[step]]))
            ids, vals = np.asarray(tops[step][0])[:k], np.asarray(tops[step][1], np.float64)[:k]
            assert (ids >= 0).all() and len(set(ids.tolist())) == k, f"step {step}: top_ids {ids.tolist()} are not {k} distinct ids"
            worst = max(worst, float(np.max(np.abs(vals - want[ids]))))
            kth = np.sort(want)[-k]
            outsiders = [int(i) for i in ids if want[i] < kth - 2 * tol]
            assert not outsiders, (
                f"model {model}, {dtype}, step {step}: top_ids {ids.tolist()} include {outsiders}, which are not "
                f"among the reference's top {k} (reference top ids {np.argsort(-want, kind='stable')[:k].tolist()})"
            )
            assert np.all(np.diff(vals) <= 2 * tol), f"step {step}: top_logprobs {vals.tolist()} are not in descending order"
        conformance.within("logprob_abs", worst, dtype, model,
                           what=f"model {model}, {dtype}: decode log-probs vs the reference")

    @_param
    def test_greedy_matches_reference(self, conformance, model, dtype):
        """Greedy tokens equal the reference's for GREEDY_STEPS steps from two prompts;
        a divergence is allowed only at a near tie (reported)."""
        conformance.require_dtype(dtype)
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
