"""Allowed-token masks in the sampler layer: what ``test_token_masks`` drives and checks.

A mask (``prefill(token_mask=...)``, ``generate(token_masks=...)``, capability
``token_masks``) sets disallowed ids to -inf in sampling step 1, before the penalties,
the temperature and the filters. The checks: a masked-out token is never produced
(greedy and sampled, on the prefill, bulk_insert and generate paths); a masked slot
yields exactly one token per step, whatever ``tokens_per_step``; the stream equals the
reference's under the same masks with each other parameter (:data:`CASES`), a slot
without a mask beside it is unchanged; and bad masks are refused before any work.

Masks are drawn from a seeded generator: a random eighth of the vocabulary, a single
token, or everything but the token the unmasked reference would pick (so the masks
change the stream: the check has power, asserted on every run).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from polyengine.errors import InvalidRequest, UnsupportedFeature
from polyengine.sampling import SamplingParams
from polyengine.sampling.masks import pack_mask, unpack_mask

from polyengine.conformance.models import DEFAULT_MODEL, build_model

__all__ = ["CASES", "STEPS", "mask_plan", "check_mask_case", "check_mask_refusals", "check_undeclared"]

STEPS = 6
# Each case composes the masks with other parameters; the stream must equal the reference's.
CASES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 1.0},
    "sampled_t0.5_top_k": {"temperature": 0.5, "top_k": 3},
    "sampled_top_p_min_p": {"temperature": 1.3, "top_p": 0.7, "min_p": 0.05},
    "penalties_bias": {"temperature": 0.8, "repetition_penalty": 1.5, "presence_penalty": 0.5,
                       "frequency_penalty": 0.5, "logit_bias": {"MASKED": 40.0}},
    "min_tokens": {"temperature": 0.0, "min_tokens": 3, "logit_bias": {"EOS": 40.0}},
}


def mask_plan(conformance, prompt: list[int], sampling: SamplingParams, salt: int) -> dict[int, np.ndarray]:
    """Per completion position, a mask as packed words; the stream under them differs
    from the unmasked stream (asserted: the case has power)."""
    oracle = conformance.oracle()
    v = oracle.model.config.vocab_size
    eos = set(oracle.eos_token_ids)
    rng = np.random.default_rng(9000 + salt)
    plain = [d.token for d in oracle.stream(prompt, sampling, STEPS)]
    masks: dict[int, np.ndarray] = {}
    completion: list[int] = []
    for j in range(STEPS):
        kind = j % 3
        allowed = np.zeros(v, bool)
        if kind == 0:  # a random eighth of the vocabulary
            allowed[rng.choice(v, size=max(2, v // 8), replace=False)] = True
        elif kind == 1:  # one token
            allowed[int(rng.integers(v))] = True
        else:  # everything but what the unmasked sampler would draw here
            allowed[:] = True
            row_stream = oracle.stream(prompt, sampling, j + 1, masks={**masks})
            allowed[row_stream[j].token] = False
        if j < sampling.min_tokens or sampling.ignore_eos:
            allowed[list(eos | set(sampling.stop_token_ids))] = False  # leave a token after step 1's own masks
            if not allowed.any():
                allowed[(max(eos) + 1) % v] = True
        masks[j] = pack_mask(allowed)
        completion.append(oracle.stream(prompt, sampling, j + 1, masks=masks)[j].token)
    assert completion != plain, f"suite bug: the masks of case {sampling} change nothing ({plain})"
    return masks


def _resolve(settings: dict[str, Any], masks: dict[int, np.ndarray], model) -> dict[str, Any]:
    """``logit_bias`` keys: EOS is the model's first EOS id; MASKED a token the first
    mask leaves out (a bias must not bring a masked token back)."""
    out = dict(settings)
    if "logit_bias" in out:
        v = model.config.vocab_size
        masked = int(np.flatnonzero(~unpack_mask(masks[0], v))[0])
        names = {"EOS": model.eos_token_ids[0], "MASKED": masked}
        out["logit_bias"] = {names.get(k, k): b for k, b in out["logit_bias"].items()}
    return out


def _never_masked(what: str, tokens: list[int], masks: dict[int, np.ndarray], vocab: int) -> None:
    for j, t in enumerate(tokens):
        if j in masks and not unpack_mask(masks[j], vocab)[t]:
            raise AssertionError(
                f"{what}: completion token #{j} is {t}, which that step's allowed-token mask leaves out (tokens "
                f"{tokens}); a mask sets disallowed ids to -inf in sampling step 1, before bias, penalties, "
                f"temperature and filters")


def check_mask_case(conformance, case: str, salt: int) -> None:
    """One case: two masked slots (one through prefill + insert, one as sample 1 of a
    bulk_insert when declared) beside an unmasked slot; every stream equals the
    reference's, and masked slots yield one token per step."""
    eng = conformance.engine()
    model = build_model(DEFAULT_MODEL)
    v = model.config.vocab_size
    prompt = conformance.prompt(7, salt)
    base = conformance.sampling(salt, **{k: x for k, x in CASES[case].items() if k != "logit_bias"})
    masks = mask_plan(conformance, prompt, base, salt)
    sampling = conformance.sampling(salt, **_resolve(CASES[case], masks, model))
    if sampling != base:
        masks = mask_plan(conformance, prompt, sampling, salt)
    conformance.require_params(*[k for k in sampling.active_fields() if k != "seed"])
    d = conformance.driver(eng)
    prefix, first = eng.prefill(params=d.params, tokens=prompt, sampling=sampling, token_mask=masks[0])
    d.insert_prefix(0, prefix, first)
    slots = [0]
    bulk = conformance.capabilities.bulk_insert and sampling.n == 1 and eng.max_concurrent_decodes >= 3
    if bulk:
        prefix2, _ = eng.prefill(params=d.params, tokens=prompt, sampling=sampling, token_mask=masks[0])
        d.bulk_insert([1, 2], prefix2)
        d.free(1)  # keep sample 1 of the bulk insert (slot 2): its own stream, sample index 1
        slots.append(2)
    plain_slot = 1 if bulk else None
    if plain_slot is not None and eng.max_concurrent_decodes > 1:
        d.insert(plain_slot, prompt, sampling)
    while min(len(d.tokens[s]) for s in slots) < STEPS:
        step = {s: masks[len(d.tokens[s])] for s in slots if len(d.tokens[s]) < STEPS}
        before = {s: len(d.tokens[s]) for s in step}
        d.state, result = eng.generate(d.params, d.state, token_masks=step)
        for s in sorted(d.live):
            d._record(s, result, s)
        for s in step:
            got = len(d.tokens[s]) - before[s]
            assert got == 1, (
                f"token masks, case {case}: masked slot {s} yielded {got} tokens in one step; a slot given a mask "
                f"yields exactly one token in that step (the mask is for its next token only)")
    for s, index in zip(slots, (0, 1)):
        what = f"token masks, case {case}, slot {s} (sample {index})"
        got = d.tokens[s][:STEPS]
        _never_masked(what, got, masks, v)
        div = conformance.compare_to_oracle(got, prompt, sampling, what=what, sample_index=index, masks=masks)
        if div is not None and not div.near_tie:
            raise AssertionError(f"{what}: the stream under masks differs from the reference's: {div.describe()}")
    if plain_slot is not None and plain_slot in d.tokens:
        got = d.tokens[plain_slot][: len(d.tokens[plain_slot])]
        div = conformance.compare_to_oracle(got, prompt, sampling, what=f"token masks, case {case}, unmasked neighbour")
        if div is not None and not div.near_tie:
            raise AssertionError(f"token masks, case {case}: a slot without a mask, beside masked ones, left the "
                                 f"reference's stream: {div.describe()}")


def check_mask_refusals(conformance) -> None:
    """Bad masks are InvalidRequest before any work; the running slot is untouched."""
    eng = conformance.engine()
    v = eng.vocab_size
    d = conformance.driver(eng)
    prompt = conformance.prompt(7, 77)
    sampling = conformance.sampling(77, temperature=0.0)
    d.insert(0, prompt, sampling)
    ok = pack_mask(np.ones(v, bool))
    eos_only = np.zeros(v, bool)
    eos_only[list(eng.eos_token_ids)] = True
    bad = {
        "wrong length": {0: ok[:-1]},
        "wrong dtype": {0: ok.astype(np.float32)},
        "no token allowed": {0: pack_mask(np.zeros(v, bool))},
        "an empty slot": {1 % eng.max_concurrent_decodes: ok} if eng.max_concurrent_decodes > 1 else None,
    }
    for what, masks in bad.items():
        if masks is None:
            continue
        try:
            eng.generate(d.params, d.state, token_masks=masks)
        except InvalidRequest:
            continue
        raise AssertionError(f"generate(token_masks=...) with {what} was accepted; it must raise InvalidRequest "
                             f"before any work")
    for what, kw in {"no token allowed": pack_mask(np.zeros(v, bool)), "wrong length": ok[:-1]}.items():
        try:
            eng.prefill(params=d.params, tokens=prompt, sampling=sampling, token_mask=kw)
        except InvalidRequest:
            continue
        raise AssertionError(f"prefill(token_mask=...) with {what} was accepted; it must raise InvalidRequest")
    try:  # EOS only, while min_tokens masks EOS: every token would be masked
        eng.prefill(params=d.params, tokens=prompt, sampling=sampling.model_copy(update={"min_tokens": 2}),
                    token_mask=pack_mask(eos_only))
    except InvalidRequest:
        pass
    else:
        raise AssertionError("prefill accepted a mask allowing only EOS while min_tokens masks EOS: every token "
                             "would be masked; it must raise InvalidRequest")
    d.step()
    div = conformance.compare_to_oracle(d.tokens[0], prompt, sampling, what="after refused masks")
    if div is not None and not div.near_tie:
        raise AssertionError(f"a refused mask changed the running slot: {div.describe()}")


def check_undeclared(conformance) -> str:
    """An engine that does not declare ``token_masks``: one that has the keywords must
    refuse a mask with UnsupportedFeature (one without them is never given masks)."""
    eng = conformance.engine()
    d = conformance.driver(eng)
    prompt = conformance.prompt(7, 78)
    sampling = conformance.sampling(78)
    ok = pack_mask(np.ones(eng.vocab_size, bool))
    said = []
    if "token_mask" in inspect.signature(eng.prefill).parameters:
        try:
            eng.prefill(params=d.params, tokens=prompt, sampling=sampling, token_mask=ok)
        except UnsupportedFeature:
            said.append("prefill")
        else:
            raise AssertionError("prefill(token_mask=...) ran on a backend that does not declare token_masks; "
                                 "it must raise UnsupportedFeature")
    if "token_masks" in inspect.signature(eng.generate).parameters:
        d.insert(0, prompt, sampling)
        try:
            eng.generate(d.params, d.state, token_masks={0: ok})
        except UnsupportedFeature:
            said.append("generate")
        else:
            raise AssertionError("generate(token_masks=...) ran on a backend that does not declare token_masks; "
                                 "it must raise UnsupportedFeature")
    return ", ".join(said) or "no mask keywords (the driver never passes masks)"
