"""Layer 2, contract: slots, insert, free, overrides, limits, result rows, errors.

(Prefixes, bulk_insert and the refusals at construction are in ``layer_prefixes``.)

These tests use seeded sampling at temperature 1 (the default, so no capability is
needed) on the default model: a sampled stream reacts to any state that leaks in,
where a greedy one on a tiny model often would not. Runs of the same request are
compared with each other; where they part, the reference's margin at that point says
whether it was a near tie (reported) or a fault (failed).
"""

from __future__ import annotations

import numpy as np
import pytest

from polyengine.engine import Override
from polyengine.errors import InvalidRequest, SlotError

from polyengine.conformance import layer

STEPS = 8


def _alone(conformance, slot, prompt, sampling, steps=STEPS):
    d = conformance.driver(conformance.engine())
    return d.run(slot, prompt, sampling, steps)


@layer("contract")
class ContractLayer:
    def test_slot_isolation(self, conformance):
        """Inserting, generating and freeing other slots never changes a slot's tokens."""
        prompts = {name: conformance.prompt(n, salt) for name, n, salt in (("A", 9, 1), ("B", 5, 2), ("C", 13, 3), ("D", 7, 4))}
        req = {name: conformance.sampling(i) for i, name in enumerate(prompts)}
        want_a = _alone(conformance, 2, prompts["A"], req["A"], 12)
        want_d = _alone(conformance, 0, prompts["D"], req["D"], 6)

        d = conformance.driver(conformance.engine())
        log: list[tuple[int, str]] = []  # (tokens A had before it happened, event)

        def act(desc, fn, *args):
            log.append((len(d.tokens.get(2, [])), desc))
            fn(*args)

        act("insert A into slot 2", d.insert, 2, prompts["A"], req["A"])
        act("insert into slot 0", d.insert, 0, prompts["B"], req["B"])
        for _ in range(3):
            act("generate", d.step)
        act("insert into slot 1", d.insert, 1, prompts["C"], req["C"])
        for _ in range(2):
            act("generate", d.step)
        act("free_resource(slot 0)", d.free, 0)
        act("insert into slot 0 (reused)", d.insert, 0, prompts["D"], req["D"])
        for _ in range(2):
            act("generate", d.step)
        act("free_resource(slot 1)", d.free, 1)
        while len(d.tokens[2]) < 12 or len(d.tokens[0]) < 6:
            act("generate", d.step)

        div = conformance.compare_pair(d.tokens[2][:12], want_a, prompts["A"], req["A"], what="slot 2 (request A)")
        if div is not None and not div.near_tie:
            before = [e for n, e in log if n == div.step]
            raise AssertionError(
                f"slot 2's tokens changed when other slots were used (token #{div.step}: {div.got} instead of "
                f"{div.want} when run alone; events just before: {', '.join(before) or 'none'}): state leaks "
                f"between slots"
            )
        div = conformance.compare_pair(d.tokens[0][:6], want_d, prompts["D"], req["D"], what="slot 0 (request D)")
        if div is not None and not div.near_tie:
            raise AssertionError(
                f"a request inserted into freed slot 0 got different tokens than alone in a fresh state "
                f"(token #{div.step}: {div.got} instead of {div.want}): the previous occupant's state leaks into "
                f"the reused slot"
            )

    def test_free_resource_then_reuse(self, conformance):
        """After free_resource a slot reports valid == 0; it can then take a new request
        that behaves as in a fresh state; freeing an empty slot is allowed."""
        eng = conformance.engine()
        pa, pb, pc = conformance.prompt(6, 11), conformance.prompt(4, 12), conformance.prompt(10, 13)
        sa, sb, sc = conformance.sampling(11), conformance.sampling(12), conformance.sampling(13)
        want_c = _alone(conformance, 1, pc, sc, 5)
        d = conformance.driver(eng)
        d.insert(1, pa, sa)
        d.insert(0, pb, sb)
        d.step(n=2)
        d.free(1)
        result = d.step()
        assert not np.asarray(result.valid[1]).any(), (
            f"slot 1 still reports valid tokens ({result.row_tokens(1)}) after free_resource(slot 1): the slot "
            f"was not emptied (free_resource must leave valid == 0 until the next insert)"
        )
        try:
            d.insert(1, pc, sc)
        except SlotError as exc:
            raise AssertionError(
                f"inserting into slot 1 after free_resource(slot 1) raised SlotError ({exc}): free_resource did "
                f"not empty the slot"
            ) from None
        while len(d.tokens[1]) < 5:
            d.step()
        div = conformance.compare_pair(d.tokens[1][:5], want_c, pc, sc, what="reused slot 1")
        assert div is None or div.near_tie, (
            f"a request in reused slot 1 differs from the same request in a fresh state (token #{div.step}: "
            f"{div.got} vs {div.want}): free_resource left state behind"
        )
        d.free(3)  # never occupied: allowed, a no-op
        d.free(1)
        d.free(1)

    def test_insert_into_occupied_slot(self, conformance):
        """Insert into an occupied slot raises SlotError and leaves the slot's request intact."""
        pa, pb = conformance.prompt(8, 21), conformance.prompt(5, 22)
        sa, sb = conformance.sampling(21), conformance.sampling(22)
        want = _alone(conformance, 0, pa, sa, 6)
        d = conformance.driver(conformance.engine())
        d.insert(0, pa, sa)
        d.step(n=2)
        prefix, _ = d.prefill(pb, sb)
        with pytest.raises(SlotError):
            d.state = d.engine.insert(prefix, d.state, 0)
        while len(d.tokens[0]) < 6:
            d.step()
        div = conformance.compare_pair(d.tokens[0][:6], want, pa, sa, what="slot 0 after a refused insert")
        assert div is None or div.near_tie, (
            f"slot 0's tokens changed after a refused insert into it (token #{div.step}: {div.got} vs {div.want}): "
            f"a refused insert must leave the state unchanged"
        )

    def test_bad_slot_indices(self, conformance):
        """Out-of-range slots raise SlotError in insert and free_resource; overrides for
        a slot that does not exist are refused as InvalidRequest; the state stays usable."""
        eng = conformance.engine()
        d = conformance.driver(eng)
        prefix, _ = d.prefill(conformance.prompt(4, 31), conformance.sampling(31))
        n = eng.max_concurrent_decodes
        for slot in (-1, n, n + 7):
            with pytest.raises(SlotError):
                d.state = eng.insert(prefix, d.state, slot)
            with pytest.raises(SlotError):
                d.state = eng.free_resource(d.state, slot)
        d.insert(0, conformance.prompt(4, 31), conformance.sampling(31))
        with pytest.raises(InvalidRequest):
            d.state, _ = eng.generate(d.params, d.state, overrides={n: 3})
        result = d.step()
        assert result.valid[0].any(), "slot 0 produced no token after refused calls: a refusal changed the state"

    def test_prompt_length_limits(self, conformance):
        """A prompt of max_prefill_length tokens runs; one more, an empty prompt or an
        out-of-vocabulary id raise InvalidRequest before any work."""
        eng = conformance.engine()
        d = conformance.driver(eng)
        longest = conformance.prompt(eng.max_prefill_length, 41)
        d.insert(0, longest, conformance.sampling(41))
        assert d.step().valid[0].any(), f"a prompt of exactly max_prefill_length={eng.max_prefill_length} produced no decode token"
        bad = {
            f"{eng.max_prefill_length + 1} tokens (max_prefill_length + 1)": longest + [5],
            "an empty prompt": [],
            f"token id {eng.vocab_size} (= vocab_size)": [1, 2, eng.vocab_size],
            "token id -1": [1, -1, 2],
        }
        for what, tokens in bad.items():
            try:
                eng.prefill(params=d.params, tokens=tokens, sampling=conformance.sampling(41))
            except InvalidRequest:
                continue
            except Exception as exc:
                raise AssertionError(f"prefill of {what} raised {type(exc).__name__}: {exc}; expected InvalidRequest") from None
            raise AssertionError(f"prefill accepted {what}; expected InvalidRequest")

    def test_overrides_force_next_input(self, conformance):
        """generate(overrides={slot: Override(f, position)}) makes f the slot's completion
        token at that position (dropping what its last result held after it) and feeds
        it: what follows equals the reference's continuation of prompt + forced tokens,
        the step counter counts f, and other slots are not affected. Written for any
        tokens_per_step: the position is the first token of the slot's last result."""
        pa, pb = conformance.prompt(7, 51), conformance.prompt(9, 52)
        sa, sb = conformance.sampling(51), conformance.sampling(52)
        want_b = _alone(conformance, 0, pb, sb, 6)
        d = conformance.driver(conformance.engine())
        d.insert(1, pa, sa)
        d.insert(0, pb, sb)
        d.step()
        position = len(d.tokens[1]) - d.last[1]  # 1: the first token of the step just taken
        sampled = d.tokens[1][position]
        # A forced token whose continuation differs from the sampled one's (on a tiny
        # model, a seeded stream often shrugs off a one-token change of context).
        oracle = conformance.oracle()
        steps = position + 5
        plain = [x.token for x in oracle.stream(pa, sa, steps)]
        forced = next(
            f for f in ((sampled + 57 * i) % d.engine.vocab_size for i in range(1, 64))
            if f != sampled and [x.token for x in oracle.stream(pa, sa, steps, forced={position: f})][position + 1:]
            != plain[position + 1:]
        )
        d.step(overrides={1: d.force(1, forced, position)})
        while len(d.tokens[1]) < steps or len(d.tokens[0]) < 6:
            d.step()
        got = d.tokens[1][:steps]
        div = conformance.compare_to_oracle(got, pa, sa, forced={position: forced}, what="slot 1 after an override")
        if div is not None and not div.near_tie:
            if plain[position + 1:] == got[position + 1:]:
                raise AssertionError(
                    f"after generate(overrides={{1: Override({forced}, {position})}}) slot 1 continued as if it had fed "
                    f"its sampled token {sampled}: overrides are ignored (the token fed must be the override)"
                )
            raise AssertionError(
                f"after generate(overrides={{1: Override({forced}, {position})}}) slot 1's tokens differ from the "
                f"reference's continuation of prompt + forced tokens ({div.describe()}): the override is not fed as the "
                f"next input, the tokens after its position are not dropped, or the step counter does not count it"
            )
        div = conformance.compare_pair(d.tokens[0][:6], want_b, pb, sb, what="slot 0 beside an override")
        assert div is None or div.near_tie, f"an override for slot 1 changed slot 0's tokens (token #{div.step})"

    def test_override_counts_for_penalties(self, conformance):
        """A forced token is a completion token for the penalties: after it, the
        repetition/presence/frequency penalties count it (not the token it replaced)."""
        name = next((n for n in ("presence_penalty", "frequency_penalty", "repetition_penalty") if conformance.declares(n)), None)
        if name is None:
            pytest.skip("no penalty is declared: nothing counts completion tokens")
        sampling = conformance.sampling(55, **{name: 2.0})
        prompt = conformance.prompt(7, 55)
        oracle = conformance.oracle()
        d = conformance.driver(conformance.engine())
        d.insert(0, prompt, sampling)
        d.step()
        position = len(d.tokens[0]) - d.last[0]
        sampled = d.tokens[0][position]
        # the reference's favourite there that the completion does not hold yet: the
        # penalty on it (or its absence) shows at once
        ranked = [int(t) for t in np.argsort(-oracle.logits(prompt + d.tokens[0][:position]), kind="stable")]
        forced = next(t for t in ranked if t != sampled and t not in d.tokens[0])
        d.step(overrides={0: d.force(0, forced, position)})
        steps = position + 9
        while len(d.tokens[0]) < steps:
            d.step()
        div = conformance.compare_to_oracle(d.tokens[0][:steps], prompt, sampling, forced={position: forced},
                                            what=f"{name}=2.0 after an override")
        assert div is None or div.near_tie, (
            f"with {name}=2.0, after forcing token {forced} in place of {sampled} at completion position {position}: "
            f"{div.describe()}: the penalties must count the forced token as the slot's completion token (and no "
            f"longer the token it replaced)"
        )

    def test_override_refusals(self, conformance):
        """Overrides with a token outside the vocabulary, a non-integer token, an empty
        slot or a position outside the slot's last result raise InvalidRequest before
        any work; the slot then goes on as if nothing happened."""
        eng = conformance.engine()
        prompt, sampling = conformance.prompt(6, 57), conformance.sampling(57)
        want = _alone(conformance, 0, prompt, sampling, 6)
        d = conformance.driver(eng)
        d.insert(0, prompt, sampling)
        d.step()
        length, last = len(d.tokens[0]), d.last[0]
        bad = {
            f"token {eng.vocab_size} (= vocab_size)": {0: eng.vocab_size},
            "token -1": {0: -1},
            "token 3.0 (a float)": {0: 3.0},
            "slot 2 (empty)": {2: 3},
            f"position {length} (after the last token)": {0: Override(3, length)},
        }
        if length - last - 1 >= 0:
            bad[f"position {length - last - 1} (before the slot's last result)"] = {0: Override(3, length - last - 1)}
        for what, overrides in bad.items():
            try:
                eng.generate(d.params, d.state, overrides=overrides)
            except InvalidRequest:
                continue
            except Exception as exc:
                raise AssertionError(f"generate with an override of {what} raised {type(exc).__name__} ({exc}); "
                                     f"expected InvalidRequest") from None
            raise AssertionError(f"generate accepted an override of {what}; expected InvalidRequest before any work")
        while len(d.tokens[0]) < 6:
            d.step()
        div = conformance.compare_pair(d.tokens[0][:6], want, prompt, sampling, what="slot 0 after refused overrides")
        assert div is None or div.near_tie, (
            f"slot 0's tokens changed after refused overrides (token #{div.step}): refusals must come before any work"
        )

    def test_cache_limit(self, conformance):
        """A slot yields tokens until prompt + completion == max_cache_length, exactly,
        each equal to the reference's; then it reports valid == 0 (with its length), and
        other slots go on."""
        eng = conformance.engine()
        n = eng.max_prefill_length - 4
        prompt, sampling = conformance.prompt(n, 58), conformance.sampling(58)
        room = eng.max_cache_length - n
        d = conformance.driver(eng)
        d.insert(0, prompt, sampling)
        for _ in range(room + 2):  # bounded: a slot that never stops fails below
            before = len(d.tokens[0])
            result = d.step()
            if len(d.tokens[0]) == before:
                break
        got = d.tokens[0]
        assert len(got) == room, (
            f"a slot with a {n}-token prompt yielded {len(got)} completion tokens; with max_cache_length="
            f"{eng.max_cache_length} it must yield exactly {room} (prompt + completion <= max_cache_length, then "
            f"valid == 0)"
        )
        assert int(result.lengths[0]) == room, (
            f"a full slot reported valid={result.valid[0].tolist()}, lengths={int(result.lengths[0])}: it must report "
            f"valid == 0 and its length {room}"
        )
        div = conformance.compare_to_oracle(got, prompt, sampling, what="a slot run to the cache limit")
        assert div is None or div.near_tie, (
            f"a slot run to max_cache_length: {div.describe()}: the tokens near the end of the cache are wrong "
            f"(a cache that wraps around or drops positions?)"
        )
        d.insert(1, conformance.prompt(5, 59), conformance.sampling(59))
        assert d.step().valid[1].any(), "another slot produced no token beside a full one"

    def test_result_lengths(self, conformance):
        """Every ResultTokens row: the valid tokens come first and number at most
        tokens_per_step; lengths counts the slot's completion tokens including them
        (0 for an empty slot); prefill's and bulk_insert's rows hold one token with
        lengths 1."""
        eng = conformance.engine()
        k = eng.capabilities.tokens_per_step
        d = conformance.driver(eng)
        problems: list[str] = []

        def check(result, when):
            valid = np.asarray(result.valid, bool)
            for slot in range(eng.max_concurrent_decodes):
                row = valid[slot]
                count = int(row.sum())
                if count and not row[:count].all():
                    problems.append(f"{when}: slot {slot}'s valid tokens are not first in its row ({row.tolist()})")
                if count > k:
                    problems.append(f"{when}: slot {slot} got {count} tokens, more than tokens_per_step={k}")
                want = len(d.tokens.get(slot, [])) if slot in d.live else 0
                if int(result.lengths[slot]) != want:
                    problems.append(f"{when}: lengths[{slot}] = {int(result.lengths[slot])}, the slot's completion "
                                    f"holds {want} tokens")

        d.insert(0, conformance.prompt(5, 60), conformance.sampling(60))
        for i in range(2):
            check(d.step(), f"step {i + 1} (slot 0 alone)")
        d.insert(2, conformance.prompt(8, 61), conformance.sampling(61))
        for i in range(2):
            check(d.step(), f"step {i + 1} after inserting slot 2")
        d.free(0)
        check(d.step(), "after freeing slot 0")
        if eng.capabilities.bulk_insert:
            prefix, _ = d.prefill(conformance.prompt(4, 62), conformance.sampling(62, n=2))
            rows = d.bulk_insert([3, 1], prefix)
            if [int(x) for x in rows.lengths] != [1, 1]:
                problems.append(f"bulk_insert's lengths are {rows.lengths.tolist()}, expected [1, 1]")
            for i in range(2):
                check(d.step(), f"step {i + 1} after bulk_insert into slots 3, 1")
        assert not problems, "ResultTokens rows break the protocol: " + "; ".join(problems[:5])
