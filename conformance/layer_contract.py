"""Layer 2, contract: slots, insert, free, overrides, limits, errors, prefix exchange.

These tests use seeded sampling at temperature 1 (the default, so no capability is
needed) on the default model: a sampled stream reacts to any state that leaks in,
where a greedy one on a tiny model often would not. Runs of the same request are
compared with each other; where they part, the reference's margin at that point says
whether it was a near tie (reported) or a fault (failed).
"""

from __future__ import annotations

import numpy as np
import pytest

from polyengine.errors import InvalidRequest, SlotError, UnsupportedFeature
from polyengine.prefix import PortablePrefix

from polyengine.conformance import layer
from polyengine.conformance.harness import LIMITS, VARIANTS
from polyengine.conformance.models import DEFAULT_MODEL, build_model
from polyengine.conformance.stats import rel_l2

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
        """generate(overrides={slot: f}) feeds f instead of the sampled token: what
        follows equals the reference's continuation of prompt + forced tokens, the
        step counter counts f, and other slots are not affected."""
        pa, pb = conformance.prompt(7, 51), conformance.prompt(9, 52)
        sa, sb = conformance.sampling(51), conformance.sampling(52)
        want_b = _alone(conformance, 0, pb, sb, 6)
        d = conformance.driver(conformance.engine())
        d.insert(1, pa, sa)
        d.insert(0, pb, sb)
        d.step()  # slot 1 now holds [t0, t1]; t1 is what it would feed next
        sampled = d.tokens[1][1]
        # A forced token whose continuation differs from the sampled one's (on a tiny
        # model, a seeded stream often shrugs off a one-token change of context).
        oracle = conformance.oracle()
        plain = [x.token for x in oracle.stream(pa, sa, 6)]
        forced = next(
            f for f in ((sampled + 57 * i) % d.engine.vocab_size for i in range(1, 64))
            if f != sampled and [x.token for x in oracle.stream(pa, sa, 6, forced={1: f})][2:] != plain[2:]
        )
        d.step(overrides={1: forced})
        d.step(n=3)
        got = [d.tokens[1][0], forced] + d.tokens[1][2:6]
        div = conformance.compare_to_oracle(got, pa, sa, forced={1: forced}, what="slot 1 after an override")
        if div is not None and not div.near_tie:
            if plain[2:] == d.tokens[1][2:6]:
                raise AssertionError(
                    f"after generate(overrides={{1: {forced}}}) slot 1 continued as if it had fed its sampled token "
                    f"{sampled}: overrides are ignored (the token fed must be the override)"
                )
            raise AssertionError(
                f"after generate(overrides={{1: {forced}}}) slot 1's tokens differ from the reference's continuation of "
                f"prompt + forced tokens ({div.describe()}): the override is not fed as the next input, or the step "
                f"counter does not count forced tokens"
            )
        div = conformance.compare_pair(d.tokens[0][:6], want_b, pb, sb, what="slot 0 beside an override")
        assert div is None or div.near_tie, f"an override for slot 1 changed slot 0's tokens (token #{div.step})"

    def test_bulk_insert_independent_first_tokens(self, conformance):
        """bulk_insert gives slots[i] sample i: its own first token (sample index i,
        step 0) and its own stream; undeclared, it raises UnsupportedFeature."""
        eng = conformance.engine()
        d = conformance.driver(eng)
        prompt = conformance.prompt(6, 61)
        sampling = conformance.sampling(61, n=LIMITS["max_slots"])
        if not eng.capabilities.bulk_insert:
            with pytest.raises(UnsupportedFeature):
                eng.prefill(params=d.params, tokens=prompt, sampling=sampling)
            prefix, _ = d.prefill(prompt, conformance.sampling(61))
            with pytest.raises(UnsupportedFeature):
                eng.bulk_insert(prefix, d.state, [0, 1])
            return
        prefix, first = d.prefill(prompt, sampling)
        slots = list(range(sampling.n))
        rows = d.bulk_insert(slots, prefix)
        firsts = [int(rows.tokens[i, 0]) for i in range(len(slots))]
        assert firsts[0] == int(first.tokens[0, 0]), (
            f"bulk_insert's row 0 first token {firsts[0]} differs from prefill's sample-0 first token {int(first.tokens[0, 0])}"
        )
        d.step(n=3)
        oracle = conformance.oracle()
        for i in slots:
            div = conformance.compare_to_oracle(d.tokens[i][:4], prompt, sampling, sample_index=i, what=f"bulk slot {i}")
            if div is None or div.near_tie:
                continue
            if div.step == 0 and len(set(firsts)) == 1:
                raise AssertionError(
                    f"bulk_insert gave every slot the same first token {firsts[0]}: each slot must draw its own "
                    f"first token (sample index i, step 0), not share sample 0's"
                )
            want0 = oracle.stream(prompt, sampling, 1, sample_index=0)[0].token
            hint = " (it drew sample 0's token)" if div.step == 0 and div.got == want0 else ""
            raise AssertionError(f"bulk_insert slot {i} (sample {i}){hint}: {div.describe()}")

    def test_prefill_bucket_invariance(self, conformance):
        """Engines built with different prefill_buckets give the same logits, first
        tokens and streams (padding is invisible)."""
        dtype = conformance.dtype
        engines = {v: conformance.engine(DEFAULT_MODEL, dtype, v) for v in VARIANTS}
        for length in (3, 8, 13, LIMITS["max_prefill_length"]):
            prompt = conformance.prompt(length, 71)
            sampling = conformance.sampling(71)
            runs = {}
            for v, eng in engines.items():
                d = conformance.driver(eng)
                prefix = d.insert(0, prompt, sampling)
                d.step(n=3)
                runs[v] = (prefix.host_logits().astype(np.float64), d.tokens[0][:4])
            base_logits, base_tokens = runs["standard"]
            for v, (logits, tokens) in runs.items():
                if v == "standard":
                    continue
                buckets = VARIANTS[v]["prefill_buckets"]
                conformance.within(
                    "bucket_rel_l2", rel_l2(logits, base_logits), dtype,
                    what=f"prompt length {length}: logits with prefill_buckets={buckets} vs none",
                )
                div = conformance.compare_pair(tokens, base_tokens, prompt, sampling, what=f"buckets {buckets}, length {length}")
                assert div is None or div.near_tie, (
                    f"with prefill_buckets={buckets} a prompt of length {length} gives token #{div.step} = {div.got}, "
                    f"without buckets {div.want}: padding changes results"
                )

    def test_prefix_reuse(self, conformance):
        """prefill(existing_prefix=head) continues a prompt exactly as one prefill of
        the whole; undeclared (prefix_reuse), it raises UnsupportedFeature."""
        eng = conformance.engine()
        d = conformance.driver(eng)
        whole = conformance.prompt(12, 81)
        sampling = conformance.sampling(81)
        head, _ = d.prefill(whole[:5], sampling)
        if not eng.capabilities.prefix_reuse:
            with pytest.raises(UnsupportedFeature):
                eng.prefill(params=d.params, tokens=whole[5:], sampling=sampling, existing_prefix=head)
            return
        tail, first = eng.prefill(params=d.params, tokens=whole[5:], sampling=sampling, existing_prefix=head)
        assert list(np.asarray(tail.prompt_tokens)) == whole, (
            f"prefix reuse: the continued prefix holds prompt {list(tail.prompt_tokens)}, expected {whole}"
        )
        want = conformance.oracle().logits(whole)
        conformance.within("logits_rel_l2", rel_l2(tail.host_logits(), want), conformance.dtype, DEFAULT_MODEL,
                           what="logits of a prompt continued from an existing prefix vs the reference")
        div = conformance.compare_to_oracle([int(first.tokens[0, 0])], whole, sampling, what="first token after prefix reuse")
        assert div is None or div.near_tie, f"prefix reuse: {div.describe()}"

    def test_portable_prefix_roundtrip(self, conformance):
        """export_prefix/import_prefix move a prefix between this backend and the
        reference in both directions (through the byte format); undeclared
        (portable_prefix), both raise UnsupportedFeature."""
        from polyengine.backends.reference.engine import ReferenceEngine

        eng = conformance.engine()
        dtype = conformance.dtype
        model = build_model(DEFAULT_MODEL)
        ref = ReferenceEngine(model, conformance.harness.config("float64"))
        ref_params = ref.load_params()
        prompt, sampling = conformance.prompt(10, 91), conformance.sampling(91)
        ref_prefix, _ = ref.prefill(params=ref_params, tokens=prompt, sampling=sampling)
        d = conformance.driver(eng)
        own, _ = d.prefill(prompt, sampling)
        if not eng.capabilities.portable_prefix:
            with pytest.raises(UnsupportedFeature):
                eng.export_prefix(own)
            with pytest.raises(UnsupportedFeature):
                eng.import_prefix(ref.export_prefix(ref_prefix))
            return
        oracle = conformance.oracle()
        # this backend -> reference
        exported = PortablePrefix.from_bytes(eng.export_prefix(own).to_bytes())
        want_k, want_v = oracle.kv(prompt)
        conformance.within("kv_rel_l2", max(rel_l2(exported.k.ravel(), want_k.ravel()), rel_l2(exported.v.ravel(), want_v.ravel())),
                           dtype, what="exported K/V vs the reference's (K after rotate-half RoPE)")
        conformance.within("logits_rel_l2", rel_l2(exported.last_logits, oracle.logits(prompt)), dtype,
                           what="exported last logits vs the reference")
        assert exported.prompt_tokens.tolist() == prompt and exported.sampling.seed == own.sampling.seed, (
            "the exported prefix must carry the prompt ids and the request's seed"
        )
        rd = conformance.driver(ref)
        rd.insert_prefix(0, ref.import_prefix(exported))
        rd.step(n=4)
        div = conformance.compare_to_oracle(rd.tokens[0][:5], prompt, sampling, dtype=dtype,
                                            what="reference continuing this backend's exported prefix")
        assert div is None or div.near_tie, f"the reference continuing this backend's exported prefix: {div.describe()}"
        # reference -> this backend
        imported = eng.import_prefix(PortablePrefix.from_bytes(ref.export_prefix(ref_prefix).to_bytes()))
        d.insert_prefix(0, imported)
        d.step(n=4)
        div = conformance.compare_to_oracle(d.tokens[0][:5], prompt, sampling, dtype=dtype,
                                            what="this backend continuing the reference's exported prefix")
        assert div is None or div.near_tie, f"this backend continuing a prefix exported by the reference: {div.describe()}"
