"""Layer 4, sampler statistics: support, goodness of fit, invariances.

Samples come from both sampler paths. Each round prefills the same prompt with
``max_slots`` different seeds (prefill path: the first token, step 0), inserts the
prefixes, and runs one generate step with every slot forced to feed the same token
(decode path: step 1, every slot on the same context). Prefill draws are judged
against the backend's own ``Prefix.host_logits()``; decode draws against the
reference's logits for that context (the backend does not expose them).

Support: no sample falls outside the float64 top-k/top-p/min-p set; tokens a
lower-precision sampler may keep by rounding at a boundary (``support_slack``) are
reported, not failed. Goodness of fit: Pearson's chi-square against the exact
filtered distribution fails below ``ALPHA``.

False-failure rates: for a correct sampler and randomly chosen seeds, each
goodness-of-fit check fails with probability ``ALPHA = 1e-4`` (two paths times seven
settings: at most 1.4e-3 for the layer). The seeds are fixed, so a run is
deterministic, and a correct backend draws the very tokens the reference sampler
draws (the counter-based stream), so it meets the same statistics, which pass.
The invariance checks are exact (same seed, same tokens) except at near ties.

Two settings sample at a temperature other than 1 with the additive terms of the
sampler's first steps, a logit_bias (temperature 1.7) and the three penalties
(temperature 0.5): applied after the temperature division instead of before it,
they shift the distribution far beyond what the chi-square tolerates. Both are
fixed by the reference's logits for the suite's prompt (see ``_resolve_setting``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from polyengine.sampling import RowState, SamplingParams, filtered_probs

from polyengine.conformance import layer
from polyengine.conformance import masks as token_masks
from polyengine.conformance.harness import SEEDS
from polyengine.conformance.models import TIE_IDS
from polyengine.conformance.faults import FAULTS, ORDER
from polyengine.conformance.stats import allowed_tokens, boundary_tokens, goodness_of_fit, noncentrality

ALPHA = 1e-4
SAMPLES = 1000  # per path and setting
_BY_RANK = "by rank"  # resolved per model: see _resolve_setting
SETTINGS = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=6),
    "top_p": dict(top_p=_BY_RANK),
    "min_p": dict(temperature=0.6, min_p=0.15),
    "combined": dict(temperature=1.3, top_k=40, top_p=0.9, min_p=0.02),
    # Additive terms at a temperature other than 1: a backend that adds them after the
    # temperature division draws from a measurably different distribution (1.7 times
    # too strong a bias, half the penalty).
    "logit_bias": dict(temperature=1.7, logit_bias=_BY_RANK),
    "penalties": dict(temperature=0.5, repetition_penalty=1.2, presence_penalty=1.0, frequency_penalty=0.5),
}
# The faults each setting must catch: the suite asserts (every run) that each fault's
# distribution is at least POWER_NONCENTRALITY away on some path (at the reference's
# precision: in a lower one the boundary band of support_slack may legitimately hide
# a fault that only moves a filter boundary).
SETTING_FAULTS = {
    "temperature": ("temperature_ignored",),
    "top_k": ("top_k_keeps_one_more",),
    "top_p": ("top_p_excludes_crossing_token",),
    "min_p": ("min_p_before_temperature",),
    "combined": ("top_p_before_top_k",),
    "logit_bias": ("bias_after_temperature",),
    "penalties": ("penalties_after_temperature",),
}
POWER_NONCENTRALITY = 100.0
_FORCED = 17  # the token every slot feeds in the decode-path round (penalty settings: see below)
_CANDIDATES = 8  # the penalty settings force the one of the reference's top 8 they act on most


@dataclass
class Draws:
    """Samples of one setting: tokens and the logits they were drawn from, per path."""

    sampling: SamplingParams  # without the seed (each draw has its own)
    prompt: list[int]
    forced: int  # the token the decode-path round feeds
    prefill_tokens: np.ndarray
    prefill_logits: np.ndarray  # the backend's own Prefix.host_logits()
    decode_tokens: np.ndarray
    decode_logits: np.ndarray  # the reference's logits after prompt + [forced]

    def row(self, path: str) -> RowState:
        completion = np.zeros(0, np.int64) if path == "prefill" else np.array([self.forced])
        return RowState(self.sampling.model_copy(update={"seed": 0}), 0, completion.size, np.array(self.prompt), completion)

    def describe(self) -> dict:
        return {**self.sampling.model_dump(exclude_defaults=True, exclude={"seed"}), "decode path forced token": self.forced}


def _resolve_setting(conformance, setting: str, prompt: list[int]) -> tuple[SamplingParams, int]:
    """The setting's parameters and the decode path's forced token, fixed by the
    reference's logits (so they fit whatever the test model is).

    ``logit_bias`` "by rank": -2 on the reference's most likely token after the prompt,
    +2 on its 3rd to 10th: the bias moves much of the mass. ``top_p`` "by rank": halfway
    through the 4th most likely token's probability, so the token that crosses top_p
    matters and sits far from any rounding boundary. Settings with penalties
    force the token, among the reference's top ``_CANDIDATES`` after the prompt, whose
    penalties move the most probability at the decode step (total variation distance
    between the distributions with and without them), so the decode path tests them
    where they matter.
    """
    oracle = conformance.oracle()
    eos = oracle.eos_token_ids
    spec = dict(SETTINGS[setting])
    ranked = [int(t) for t in np.argsort(-oracle.logits(prompt), kind="stable")]
    if spec.get("logit_bias") == _BY_RANK:
        spec["logit_bias"] = {ranked[0]: -2.0, **{t: 2.0 for t in ranked[2:10]}}
    if spec.get("top_p") == _BY_RANK:
        # halfway through the 4th most likely token's mass: four tokens are kept, and the
        # fourth (the one that carries the total past top_p) carries much of the mass
        probs = np.exp(oracle.raw_logprobs(prompt))[ranked]
        spec["top_p"] = float(np.cumsum(probs)[3] - probs[3] / 2)
    base = SamplingParams(**spec)
    forced = _FORCED
    if base.repetition_penalty != 1.0 or base.presence_penalty or base.frequency_penalty:
        plain = base.model_copy(update={"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0})

        def moved(t: int) -> float:
            x = oracle.logits(prompt + [t])
            rows = [RowState(sp.model_copy(update={"seed": 0}), 0, 1, np.array(prompt), np.array([t])) for sp in (base, plain)]
            return 0.5 * float(np.abs(filtered_probs(x, rows[0], eos) - filtered_probs(x, rows[1], eos)).sum())

        forced = max(ranked[:_CANDIDATES], key=moved)
    return base, forced


def _draw(conformance, setting: str) -> Draws:
    cache = conformance.harness.cache
    if ("draws", setting) in cache:
        return cache[("draws", setting)]
    eng = conformance.engine()
    params = conformance.harness.params(eng)
    prompt = conformance.prompt(5, 201)
    base, forced = _resolve_setting(conformance, setting, prompt)
    slots = list(range(eng.max_concurrent_decodes))
    pre, dec, logits = [], [], None
    seed = SEEDS["statistics"] + 100_000 * list(SETTINGS).index(setting)
    state = eng.init_decode_state()
    while len(dec) < SAMPLES:
        for slot in slots:
            prefix, first = eng.prefill(params=params, tokens=prompt, sampling=base.model_copy(update={"seed": seed}))
            seed += 1
            if logits is None:
                logits = np.asarray(prefix.host_logits(), np.float64)
            pre.append(int(first.tokens[0, 0]))
            state = eng.insert(prefix, state, slot)
        state, result = eng.generate(params, state, overrides={s: forced for s in slots})
        dec.extend(int(result.tokens[s, 0]) for s in slots)
        for slot in slots:
            state = eng.free_resource(state, slot)
    draws = Draws(base, prompt, forced, np.array(pre[:SAMPLES]), logits, np.array(dec[:SAMPLES]),
                  conformance.oracle().logits(prompt + [forced]))
    cache[("draws", setting)] = draws
    return draws


def _why_excluded(logits, row: RowState, eos, token: int) -> list[str]:
    """Which of the active filters, applied alone, removes ``token``."""
    p = row.params
    out = []
    for name, neutral in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
        value = getattr(p, name)
        if value == neutral:
            continue
        alone = p.model_copy(update={k: n for k, n in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)) if k != name})
        if filtered_probs(logits, RowState(alone, 0, row.step, row.prompt_tokens, row.completion_tokens), eos)[token] == 0:
            out.append(f"{name}={value}")
    return out


def _hint(setting: str) -> str:
    faults = "; ".join(FAULTS[f].message for f in SETTING_FAULTS.get(setting, ()))
    return f" (a common cause: {faults}; {ORDER})" if faults else f" ({ORDER})"


_settings = pytest.mark.parametrize("setting", list(SETTINGS))


@layer("sampler")
class SamplerLayer:
    @_settings
    def test_sampling_support(self, conformance, setting):
        """No sampled token lies outside the float64 top-k/top-p/min-p set."""
        conformance.require_params(*SETTINGS[setting])
        draws = _draw(conformance, setting)
        eos = conformance.oracle().eos_token_ids
        slack = conformance.tolerance("support_slack", conformance.dtype).value
        for path, tokens, logits in (("prefill", draws.prefill_tokens, draws.prefill_logits),
                                     ("decode", draws.decode_tokens, draws.decode_logits)):
            row = draws.row(path)
            strict, lenient = allowed_tokens(logits, row, eos, slack)
            bad = sorted({int(t) for t in tokens if not lenient[t]})
            boundary = sorted({int(t) for t in tokens if lenient[t] and not strict[t]})
            conformance.measure("support_slack", 0.0 if not bad else float("inf"), conformance.dtype, where=f"{path} path")
            if boundary:
                conformance.note(f"{path} path: tokens {boundary} sampled at a filter boundary (within support_slack)")
            if bad:
                t = bad[0]
                why = _why_excluded(logits, row, eos, t)
                count = int(np.sum(tokens == t))
                raise AssertionError(
                    f"{path} path, {draws.describe()}: sampled token {t} ({count} of {tokens.size} draws) lies outside "
                    f"the allowed set of {int(strict.sum())} tokens; excluded by {', '.join(why) or 'the filters'}: "
                    f"the backend does not apply {' / '.join(w.split('=')[0] for w in why) or 'its filters'}"
                )

    @_settings
    def test_sampling_distribution(self, conformance, setting):
        """Chi-square goodness of fit of SAMPLES draws per path against the exact
        filtered distribution; fails when p < ALPHA = 1e-4 (false-failure rate 1e-4
        per check for random seeds; deterministic with the fixed ones). Draws on
        boundary tokens (within support_slack of a filter boundary, which a correct
        lower-precision sampler may keep or drop) are left out and the test is
        conditional on the rest, which keeps its false-failure rate."""
        conformance.require_params(*SETTINGS[setting])
        draws = _draw(conformance, setting)
        eos = conformance.oracle().eos_token_ids
        slack = conformance.tolerance("support_slack", conformance.dtype).value
        stats = conformance.record.setdefault("statistics", {})
        failures = []
        for path, tokens, logits in (("prefill", draws.prefill_tokens, draws.prefill_logits),
                                     ("decode", draws.decode_tokens, draws.decode_logits)):
            row = draws.row(path)
            probs = filtered_probs(logits, row, eos)
            fit = goodness_of_fit(tokens, probs, exclude=boundary_tokens(logits, row, eos, slack))
            stats[path] = {**fit.to_dict(), "alpha": ALPHA, "support_slack": slack}
            if fit.boundary:
                conformance.note(f"{path} path: {fit.boundary} draws on boundary tokens left out of the chi-square")
            if fit.p_value < ALPHA:
                failures.append(
                    f"{path} path: chi-square {fit.statistic:.1f} on {fit.df} df, p = {fit.p_value:.2g} < {ALPHA:g}"
                    + (f" ({fit.outside} draws on zero-probability tokens)" if fit.outside else "")
                )
        assert not failures, (
            f"{draws.describe()}: sampled tokens do not follow the specified distribution: " + "; ".join(failures)
            + _hint(setting)
        )
        oracle = conformance.oracle()
        for name in SETTING_FAULTS.get(setting, ()):  # the check has power against the faults it is here for
            fault = FAULTS[name]
            power = {}
            for path, logits in (("prefill", oracle.logits(draws.prompt)), ("decode", draws.decode_logits)):
                row = draws.row(path)
                faulty = RowState(fault.request(row.params), 0, row.step, row.prompt_tokens, row.completion_tokens)
                power[path] = noncentrality(filtered_probs(logits, row, eos),
                                            filtered_probs(logits, faulty, eos, pipeline=fault.pipeline()), SAMPLES)
                stats[path][f"noncentrality_vs_{name}"] = power[path]
            assert max(power.values()) >= POWER_NONCENTRALITY, (
                f"suite bug: the {setting} setting cannot tell {name} apart (noncentrality {power}, "
                f"needs {POWER_NONCENTRALITY:g} on some path)"
            )

    @pytest.mark.parametrize("case", list(token_masks.CASES))
    def test_token_masks(self, conformance, case):
        """Allowed-token masks (capability ``token_masks``): a masked-out token is never
        produced (prefill, bulk_insert and generate paths, greedy and sampled); a masked
        slot yields one token per step; the stream equals the reference's under the same
        masks composed with the case's parameters, and an unmasked neighbour is unchanged."""
        if not conformance.capabilities.token_masks:  # the undeclared path is checked, not skipped
            conformance.note(f"token_masks not declared: {token_masks.check_undeclared(conformance)} refused masks")
            return
        token_masks.check_mask_case(conformance, case, salt=list(token_masks.CASES).index(case))

    def test_token_mask_refusals(self, conformance):
        """Bad masks (wrong length or dtype, no token allowed, an empty slot, only tokens
        min_tokens masks) raise InvalidRequest before any work; undeclared, masks raise
        UnsupportedFeature."""
        if not conformance.capabilities.token_masks:
            conformance.note(f"token_masks not declared: {token_masks.check_undeclared(conformance)} refused masks")
            return
        token_masks.check_mask_refusals(conformance)

    def test_same_seed_same_tokens(self, conformance):
        """Two requests with one seed draw the same tokens, whatever the slot and the
        time; another seed draws other tokens (equal streams of 8 tokens by chance:
        probability under 1e-5 on the default model)."""
        eng = conformance.engine()
        prompt = conformance.prompt(6, 301)
        s1, s2 = conformance.sampling(301), conformance.sampling(302)
        d = conformance.driver(eng)
        d.insert(0, prompt, s1)
        d.step(n=3)
        d.insert(3, prompt, s1)  # the same request again, later, elsewhere
        d.insert(1, prompt, s2)
        while len(d.tokens[3]) < 8:
            d.step()
        first, again, other = d.tokens[0][:8], d.tokens[3][:8], d.tokens[1][:8]
        div = conformance.compare_pair(again, first, prompt, s1, what="same seed, slot 3 vs slot 0")
        assert div is None or div.near_tie, (
            f"two requests with seed {s1.seed} got different tokens ({first} in slot 0, {again} in slot 3): the "
            f"backend does not derive its random stream from the request's seed alone (a global or per-slot stream?)"
        )
        assert other != first, f"seeds {s1.seed} and {s2.seed} drew the same 8 tokens {first}: the seed is ignored"

    def test_seeded_stream_matches_reference(self, conformance):
        """Seeded sampling draws the reference sampler's tokens (the counter-based
        Threefry stream), step after step, at temperatures 1, 0.5 and 1.7, and with
        seeds over the whole 64-bit range (above 2^32 the key's high word matters),
        except at near ties."""
        eng = conformance.engine()
        temperatures = (1.0, 0.5, 1.7) if conformance.declares("temperature") else (1.0, 1.0, 1.0)
        seeds = (None, None, None, 2**32 + 311, 2**63 + 7, 2**64 - 1)
        oracle = conformance.oracle()
        for salt, temperature, seed in zip(range(311, 317), temperatures * 2, seeds):
            prompt, sampling = conformance.prompt(4 + salt % 7, salt), conformance.sampling(salt, temperature=temperature)
            if seed is not None:
                sampling = sampling.model_copy(update={"seed": seed})
                low = [x.token for x in oracle.stream(prompt, sampling, 8, fault=FAULTS["seed_low_word_only"])]
                assert low != [x.token for x in oracle.stream(prompt, sampling, 8)], (
                    f"suite bug: seed {seed} draws the same 8 tokens with and without its high word"
                )
            got = conformance.driver(eng).run(salt % eng.max_concurrent_decodes, prompt, sampling, 8)
            div = conformance.compare_to_oracle(got, prompt, sampling, what=f"seed {sampling.seed}")
            hint = ""
            if seed is not None and got == low:
                hint = f" ({FAULTS['seed_low_word_only'].message})"
            assert div is None or div.near_tie, (
                f"seed {sampling.seed}, temperature {temperature:g}: {div.describe()}: the sampled token differs from the "
                f"counter-based stream (Threefry-2x32 keyed by the request's seed, counter (token, step + 2^20 * "
                f"sample)); the backend does not use the per-request counter-based stream{hint}"
            )

    def test_exact_ties_go_to_lowest_id(self, conformance):
        """Where two tokens tie exactly at the top (the test model's zero LM-head rows,
        lifted by the same logit_bias), greedy, top_k=1 and a tiny top_p keep the lower
        id, on the prefill and the decode path."""
        conformance.require_params("logit_bias", "temperature")
        low, high = TIE_IDS
        eng = conformance.engine()
        prompt = conformance.prompt(6, 361)
        cases = [("greedy", {"temperature": 0.0}, "greedy_ties_to_highest_id")]
        if conformance.declares("top_k"):
            cases.append(("top_k=1", {"top_k": 1}, "filter_ties_to_highest_id"))
        if conformance.declares("top_p"):
            cases.append(("top_p=0.05", {"top_p": 0.05}, "filter_ties_to_highest_id"))
        for what, settings, fault in cases:
            sampling = conformance.sampling(361, logit_bias={low: 50.0, high: 50.0}, **settings)
            got = conformance.driver(eng).run(0, prompt, sampling, 3)
            if got != [low] * 3:
                raise AssertionError(
                    f"{what} with tokens {low} and {high} tied exactly at the top (equal logits plus the same bias): the "
                    f"backend drew {got}, expected {[low] * 3}: {FAULTS[fault].message}"
                    + ("" if high in got else " (ties must go to the lowest id)")
                )

    def test_temperature_zero_is_argmax(self, conformance):
        """temperature=0 picks the argmax of the backend's own logits (ties: lowest id)."""
        conformance.require_params("temperature")
        eng = conformance.engine()
        d = conformance.driver(eng)
        for salt in range(321, 327):
            prefix, first = d.prefill(conformance.prompt(3 + salt % 5, salt), SamplingParams(temperature=0.0, seed=salt))
            logits = prefix.host_logits()
            want = int(np.argmax(logits))
            assert int(first.tokens[0, 0]) == want, (
                f"temperature=0 chose token {int(first.tokens[0, 0])} but the argmax of the prefix's own logits is {want}"
            )

    def test_top_k_one_is_greedy(self, conformance):
        """top_k=1 at any temperature and seed picks the argmax of the backend's logits."""
        conformance.require_params("top_k")
        eng = conformance.engine()
        d = conformance.driver(eng)
        for salt in range(331, 337):
            prefix, first = d.prefill(conformance.prompt(4, salt), conformance.sampling(salt, top_k=1))
            want = int(np.argmax(prefix.host_logits()))
            assert int(first.tokens[0, 0]) == want, (
                f"top_k=1 (seed {salt}) chose {int(first.tokens[0, 0])}, not the argmax {want}: top_k is not applied"
            )

    def test_samples_independent_of_slot_and_neighbours(self, conformance):
        """A request draws the same tokens alone in slot 0 and in the last slot beside
        neighbours with other parameters."""
        eng = conformance.engine()
        prompt, sampling = conformance.prompt(8, 341), conformance.sampling(341)
        alone = conformance.driver(eng).run(0, prompt, sampling, 8)
        d = conformance.driver(eng)
        last = eng.max_concurrent_decodes - 1
        neighbour_params = [conformance.sampling(342)]
        for name, value in (("temperature", 0.0), ("top_k", 3), ("top_p", 0.5)):
            if conformance.declares(name):
                neighbour_params.append(conformance.sampling(343, **{name: value}))
        for slot, sp in enumerate(neighbour_params[:last]):
            d.insert(slot, conformance.prompt(5 + slot, 350 + slot), sp)
        d.step()
        d.insert(last, prompt, sampling)
        while len(d.tokens[last]) < 8:
            d.step()
        div = conformance.compare_pair(d.tokens[last][:8], alone, prompt, sampling, what=f"slot {last} with neighbours")
        assert div is None or div.near_tie, (
            f"the same request drew token #{div.step} = {div.got} in slot {last} beside other requests but {div.want} "
            f"alone in slot 0: a request's samples depend on its slot or its neighbours"
        )
