"""Layer 2, contract (continued): prefixes and the engine's construction.

bulk_insert (each slot its own sample, rows in the order given, refusals before any
change), prefill buckets (padding is invisible), prefix reuse (at every bucket edge and
chunk boundary, in chains of continuations, the prefix left as it was, the first token
drawn with the continuing request's own parameters: what the driver's prefix cache and
chunked prefill build on), portable prefixes in both directions with the reference,
prefixes from other weights or with non-finite values or ids outside the vocabulary
refused, and the refusals an engine makes when it is built: unknown options, a cache
beyond the model, memory that would not fit.
"""

from __future__ import annotations

import numpy as np
import pytest

from polyengine.engine import PrefillRequest
from polyengine.errors import InsufficientMemory, InvalidRequest, SlotError, UnsupportedFeature
from polyengine.memory import simulated_limit
from polyengine.prefix import PortablePrefix

from polyengine.conformance import layer
from polyengine.conformance.harness import LIMITS, VARIANTS
from polyengine.conformance.models import DEFAULT_MODEL, MODEL_NAMES, build_model
from polyengine.conformance.oracle import reference_engine
from polyengine.conformance.pages import page_rule_problems
from polyengine.conformance.tails import (tail_import_problems, tail_refusal_problems, tail_sharing_problems,
                                          tail_starts)
from polyengine.conformance.stats import rel_l2

_OTHER_MODEL = next(m for m in MODEL_NAMES if m != DEFAULT_MODEL)


def _bulk_order(n: int) -> list[int]:
    """The slots in an order that is not sorted (rows must follow the order given)."""
    order = list(range(n))[::-1]
    return order[1:] + order[:1] if n > 2 else order


def _two_streams(conformance, d, seed: int) -> dict:
    """Two requests decoding through the driver ``d``: slot 0 seeded, slot 1 greedy;
    ``{slot: (prompt, sampling)}``."""
    streams = {0: (conformance.prompt(6, seed), conformance.sampling(seed)),
               1: (conformance.prompt(9, seed + 1), conformance.sampling(seed + 1, temperature=0.0))}
    for slot, (prompt, sampling) in streams.items():
        d.insert(slot, prompt, sampling)
    return streams


@layer("contract")
class PrefixLayer:
    def test_bulk_insert_independent_first_tokens(self, conformance):
        """bulk_insert gives slots[i] sample i (its own first token: sample index i,
        step 0, and its own stream), row i of its result belongs to slots[i] in the
        order given; undeclared, it raises UnsupportedFeature."""
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
        slots = _bulk_order(sampling.n)
        rows = d.bulk_insert(slots, prefix)
        firsts = [int(rows.tokens[i, 0]) for i in range(len(slots))]
        oracle = conformance.oracle()
        want_first = [oracle.stream(prompt, sampling, 1, sample_index=i)[0].token for i in range(len(slots))]
        if firsts != want_first and firsts == [want_first[slots.index(s)] for s in sorted(slots)]:
            raise AssertionError(
                f"bulk_insert(slots={slots}) returned its rows in sorted slot order ({firsts}, the reference's "
                f"{want_first}): row i must belong to slots[i], in the order given"
            )
        assert firsts[0] == int(first.tokens[0, 0]), (
            f"bulk_insert's row 0 first token {firsts[0]} differs from prefill's sample-0 first token {int(first.tokens[0, 0])}"
        )
        d.step(n=3)
        for i, slot in enumerate(slots):
            div = conformance.compare_to_oracle(d.tokens[slot][:4], prompt, sampling, sample_index=i, what=f"bulk slot {slot} (sample {i})")
            if div is None or div.near_tie:
                continue
            if div.step == 0 and len(set(firsts)) == 1:
                raise AssertionError(
                    f"bulk_insert gave every slot the same first token {firsts[0]}: each slot must draw its own "
                    f"first token (sample index i, step 0), not share sample 0's"
                )
            hint = " (it drew sample 0's token)" if div.step == 0 and div.got == want_first[0] else ""
            raise AssertionError(f"bulk_insert slots[{i}] = slot {slot} (sample {i}){hint}: {div.describe()}")

    def test_bulk_insert_refusals(self, conformance):
        """bulk_insert into an occupied, repeated or out-of-range slot raises SlotError
        and changes nothing: the other slots named stay empty."""
        eng = conformance.engine()
        if not eng.capabilities.bulk_insert:
            pytest.skip("bulk_insert is not declared; its refusal is tested by test_bulk_insert_independent_first_tokens")
        d = conformance.driver(eng)
        d.insert(1, conformance.prompt(5, 65), conformance.sampling(65))
        prefix, _ = d.prefill(conformance.prompt(6, 66), conformance.sampling(66, n=2))
        n = eng.max_concurrent_decodes
        for slots, what in (([0, 1], "slot 1 is occupied"), ([2, 2], "slot 2 twice"), ([0, n], f"slot {n} is out of range")):
            try:
                d.state, _ = eng.bulk_insert(prefix, d.state, slots)
            except SlotError:
                pass
            except Exception as exc:
                raise AssertionError(f"bulk_insert({slots}) ({what}) raised {type(exc).__name__} ({exc}); expected SlotError") from None
            else:
                raise AssertionError(f"bulk_insert({slots}) ({what}) was accepted; expected SlotError")
        for slot in (0, 2):
            try:
                d.insert(slot, conformance.prompt(4, 67 + slot), conformance.sampling(67 + slot))
            except SlotError as exc:
                raise AssertionError(
                    f"after a refused bulk_insert, slot {slot} is occupied ({exc}): a refused bulk_insert must change "
                    f"nothing (check every slot before filling any)"
                ) from None
        assert d.step().valid[1].any(), "slot 1 stopped producing tokens after refused bulk_inserts"

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
                while len(d.tokens[0]) < 4:
                    d.step()
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
                           what="logits of a prompt continued from an existing prefix vs the reference "
                                "(positions of the continuation must start where the prefix ends)")
        div = conformance.compare_to_oracle([int(first.tokens[0, 0])], whole, sampling, what="first token after prefix reuse")
        assert div is None or div.near_tie, f"prefix reuse: {div.describe()}"

    def test_truncate_prefix(self, conformance):
        """truncate_prefix (capability prefix_truncate) gives a prefix of the first tokens
        as a prefill of them would (its logits), leaves the prefix as it was, and the cut
        continues like any prefix; undeclared, the method raises UnsupportedFeature or is
        absent."""
        eng = conformance.engine()
        d = conformance.driver(eng)
        whole = conformance.prompt(12, 93)
        prefix, _ = d.prefill(whole, conformance.sampling(93))
        if not eng.capabilities.prefix_truncate:
            if callable(getattr(eng, "truncate_prefix", None)):
                with pytest.raises(UnsupportedFeature):
                    eng.truncate_prefix(params=d.params, prefix=prefix, length=7)
            return
        made = prefix.host_logits().copy()
        cut = eng.truncate_prefix(params=d.params, prefix=prefix, length=7)
        assert list(np.asarray(cut.prompt_tokens)) == whole[:7] and np.array_equal(prefix.host_logits(), made), (
            "truncate_prefix: the cut must hold the first 7 tokens and leave the prefix as it was")
        oracle = conformance.oracle()
        conformance.within("logits_rel_l2", rel_l2(cut.host_logits(), oracle.logits(whole[:7])), conformance.dtype,
                           DEFAULT_MODEL, what="logits of a truncated prefix vs the reference's prefill of its tokens")
        tail, _ = eng.prefill(params=d.params, tokens=whole[7:], sampling=conformance.sampling(94), existing_prefix=cut)
        conformance.within("logits_rel_l2", rel_l2(tail.host_logits(), oracle.logits(whole)), conformance.dtype,
                           DEFAULT_MODEL, what="logits of a truncated prefix continued to the whole prompt vs the reference")
        # continued elsewhere: other tokens, fewer than the cut-off part (an engine whose cut
        # shares the whole's storage must never read the positions past the cut)
        other = conformance.prompt(2, 95)
        fork, _ = eng.prefill(params=d.params, tokens=other, sampling=conformance.sampling(95), existing_prefix=cut)
        conformance.within("logits_rel_l2", rel_l2(fork.host_logits(), oracle.logits(whole[:7] + other)),
                           conformance.dtype, DEFAULT_MODEL,
                           what="logits of a truncated prefix continued with other tokens vs the reference")

    def test_prefix_head(self, conformance):
        """prefix_head (the kit's, capability prefix_truncate): a prefix of the first tokens
        for continuation only, with no forward run: it holds those tokens, has no logits or
        first token of its own (insert, bulk_insert, host_logits and export refuse it, the
        request's slot stays free), leaves the prefix as it was, and continues, with the
        rest or with other tokens, as a prefill of all of them would; a head of a head
        too. An engine without the method is skipped, one whose heads would not share the
        prefix's storage must refuse (the driver cuts with truncate_prefix there)."""
        eng = conformance.engine()
        if not callable(getattr(eng, "prefix_head", None)):
            pytest.skip("the engine has no prefix_head (not on the backend kit): the driver uses truncate_prefix")
        d = conformance.driver(eng)
        whole = conformance.prompt(12, 96)
        prefix, _ = d.prefill(whole, conformance.sampling(96))
        if not eng.capabilities.prefix_truncate or not getattr(eng, "shares_prefix_heads", False):
            with pytest.raises(UnsupportedFeature):
                eng.prefix_head(params=d.params, prefix=prefix, length=7)
            return
        made = prefix.host_logits().copy()
        head = eng.prefix_head(params=d.params, prefix=prefix, length=7)
        assert list(np.asarray(head.prompt_tokens)) == whole[:7] and head.logits is None and head.first_token == -1
        assert np.array_equal(prefix.host_logits(), made), "prefix_head must leave the prefix as it was"
        with pytest.raises(InvalidRequest, match="head"):
            eng.insert(head, d.state, 0)
        with pytest.raises(InvalidRequest, match="head"):
            head.host_logits()
        if eng.capabilities.portable_prefix:
            with pytest.raises(InvalidRequest, match="head"):
                eng.export_prefix(head)
        d.insert_prefix(0, prefix)  # the refused insert left slot 0 free
        d.free(0)
        oracle = conformance.oracle()
        for rest, seed in ((whole[7:], 97), (conformance.prompt(2, 98), 98)):
            cont, _ = eng.prefill(params=d.params, tokens=rest, sampling=conformance.sampling(seed), existing_prefix=head)
            conformance.within("logits_rel_l2", rel_l2(cont.host_logits(), oracle.logits(whole[:7] + list(rest))),
                               conformance.dtype, DEFAULT_MODEL, what="logits of a prefix head continued vs the reference")
        inner = eng.prefix_head(params=d.params, prefix=head, length=3)
        cont, _ = eng.prefill(params=d.params, tokens=whole[3:9], sampling=conformance.sampling(99), existing_prefix=inner)
        conformance.within("logits_rel_l2", rel_l2(cont.host_logits(), oracle.logits(whole[:9])), conformance.dtype,
                           DEFAULT_MODEL, what="logits of a head of a head continued vs the reference")

    def test_embed(self, conformance):
        """embed (capability embeddings) returns the prompt's hidden states after the final
        norm, one row per token, as the reference computes them, and changes no prefix;
        undeclared, the method raises UnsupportedFeature or is absent."""
        eng = conformance.engine()
        d = conformance.driver(eng)
        tokens = conformance.prompt(9, 97)
        if not eng.capabilities.embeddings:
            if callable(getattr(eng, "embed", None)):
                with pytest.raises(UnsupportedFeature):
                    eng.embed(params=d.params, tokens=tokens)
            return
        prefix, _ = d.prefill(tokens, conformance.sampling(97))
        made = prefix.host_logits().copy()
        hidden = np.asarray(eng.embed(params=d.params, tokens=tokens), dtype=np.float64)
        oracle = conformance.oracle()
        want = oracle.engine.embed(params=oracle.params, tokens=tokens)
        assert hidden.shape == want.shape, f"embed: hidden states of shape {hidden.shape}, expected {want.shape}"
        assert np.array_equal(prefix.host_logits(), made), "embed: a prefix changed under it"
        conformance.within("logits_rel_l2", rel_l2(hidden, want), conformance.dtype, DEFAULT_MODEL,
                           what="hidden states after the final norm (embed) vs the reference's")

    def test_prefill_batch(self, conformance):
        """prefill_batch (capability batched_prefill) gives each entry what its own prefill
        gives: prompts of different lengths from position 0 and, where prefix_reuse is
        declared, continuations of prefixes of different lengths, with greedy and seeded
        requests, in one call; each entry's prefix holds its whole prompt, its logits are
        the reference's for it and its first token the reference's draw with the entry's own
        parameters; an entry prefill would refuse refuses the call (InvalidRequest). An
        engine may lack the method without the capability; where it has it (the kit's
        loop), the same holds."""
        eng = conformance.engine()
        d = conformance.driver(eng)
        if not callable(getattr(eng, "prefill_batch", None)):
            assert not eng.capabilities.batched_prefill, "batched_prefill is declared but prefill_batch is missing"
            return
        a, b, c = conformance.prompt(11, 101), conformance.prompt(5, 102), conformance.prompt(14, 103)
        cases = [(a, 0, conformance.sampling(101)), (b, 0, conformance.sampling(102, temperature=0.0))]
        if eng.capabilities.prefix_reuse:  # starts 9 and 3: each row's positions and keys are its own
            cases += [(c, 9, conformance.sampling(103)), (a, 3, conformance.sampling(104, temperature=0.7))]
        heads = [d.prefill(whole[:start], conformance.sampling(105))[0] if start else None for whole, start, _ in cases]
        requests = [PrefillRequest(whole[start:], sampling, head) for (whole, start, sampling), head in zip(cases, heads)]
        with pytest.raises(InvalidRequest):
            bad = PrefillRequest([eng.vocab_size], cases[0][2])  # an id outside the vocabulary
            eng.prefill_batch(params=d.params, requests=[*requests[:1], bad])
        done = eng.prefill_batch(params=d.params, requests=requests)
        assert len(done) == len(requests), f"prefill_batch: {len(done)} results for {len(requests)} entries"
        oracle = conformance.oracle()
        for i, ((whole, start, sampling), (prefix, first)) in enumerate(zip(cases, done)):
            where = f"prefill_batch entry {i} ({len(whole) - start} tokens after a prefix of {start})"
            assert list(np.asarray(prefix.prompt_tokens)) == whole, (
                f"{where}: its prefix holds prompt {list(prefix.prompt_tokens)}, expected {whole}")
            conformance.within("logits_rel_l2", rel_l2(prefix.host_logits(), oracle.logits(whole)), conformance.dtype,
                               DEFAULT_MODEL, what=f"{where}: logits vs the reference's prefill of its whole prompt "
                                                   f"(each row at its own positions, seeing only its own keys)")
            div = conformance.compare_to_oracle([int(first.tokens[0, 0])], whole, sampling, what=f"{where}: first token")
            assert div is None or div.near_tie, f"{where}: {div.describe()}"

    def test_prefill_lane(self, conformance):
        """start_prefill (capability prefill_lane) beside the steps gives what prefill gives
        between them: two streams decode while the lane prefills a whole prompt and (with
        prefix_reuse) continues a prefix that a prefill on the caller's thread continues at
        the same time; the lane's prefixes (logits, first token, their streams once
        inserted), the other continuation and the streams are the reference's, and the
        continued prefix is left as it was. Undeclared, start_prefill raises
        UnsupportedFeature or is absent."""
        eng = conformance.engine()
        d = conformance.driver(eng)
        start = getattr(eng, "start_prefill", None)
        limit = LIMITS["max_prefill_length"]
        long_prompt, long_sampling = conformance.prompt(limit, 121), conformance.sampling(121)
        if not eng.capabilities.prefill_lane:
            if callable(start):
                with pytest.raises(UnsupportedFeature):
                    start(params=d.params, tokens=long_prompt, sampling=long_sampling)
            return
        assert callable(start), "prefill_lane is declared but start_prefill is missing"
        streams = _two_streams(conformance, d, 122)
        d.step()
        lane = []  # (what, whole prompt, sampling, future)
        head = beside = None
        if eng.capabilities.prefix_reuse:  # two continuations of one prefix at once: one on the lane
            whole_a = conformance.prompt(limit, 124)
            whole_b = whole_a[:8] + conformance.prompt(limit - 8, 125)
            head, _ = d.prefill(whole_a[:8], conformance.sampling(126))
            head_logits = head.host_logits().copy()
            sa, sb = conformance.sampling(127), conformance.sampling(128, temperature=0.0)
            lane.append(("the lane's continuation of a prefix", whole_a, sa,
                         start(params=d.params, tokens=whole_a[8:], sampling=sa, existing_prefix=head)))
            beside = (whole_b, sb, eng.prefill(params=d.params, tokens=whole_b[8:], sampling=sb, existing_prefix=head))
        lane.append(("the lane's prefill", long_prompt, long_sampling,
                     start(params=d.params, tokens=long_prompt, sampling=long_sampling)))
        room = LIMITS["max_cache_length"] - 12
        d.step(n=2)  # the steps go on while the lane runs, and at least twice
        while not all(f.done() for *_, f in lane) and len(d.tokens[1]) < room:
            d.step()
        oracle = conformance.oracle()
        done = [(what, whole, sampling, *future.result(timeout=600)) for what, whole, sampling, future in lane]
        if beside is not None:
            done.append(("a continuation beside the lane's", beside[0], beside[1], *beside[2]))
        for what, whole, sampling, prefix, first in done:
            conformance.within("logits_rel_l2", rel_l2(prefix.host_logits(), oracle.logits(whole)), conformance.dtype,
                               DEFAULT_MODEL, what=f"{what}: logits vs the reference's prefill of its whole prompt")
            div = conformance.compare_to_oracle([int(first.tokens[0, 0])], whole, sampling, what=f"{what}: first token")
            assert div is None or div.near_tie, f"{what}: {div.describe()}"
        if head is not None:
            assert np.array_equal(head.host_logits(), head_logits), (
                "continuing a prefix on the lane and beside it changed the prefix continued")
        for slot, (prompt, sampling) in streams.items():
            div = conformance.compare_to_oracle(d.tokens[slot], prompt, sampling,
                                                what=f"slot {slot}, decoding while the lane prefilled")
            assert div is None or div.near_tie, f"slot {slot}, decoding while the lane prefilled: {div.describe()}"
        for slot, (what, whole, sampling, prefix, first) in zip((2, 3), done):
            d.free(0) if slot == 2 else d.free(1)
            d.insert_prefix(slot, prefix, first)
        d.step(n=3)
        for slot, (what, whole, sampling, prefix, first) in zip((2, 3), done):
            div = conformance.compare_to_oracle(d.tokens[slot], whole, sampling, what=f"{what}, inserted")
            assert div is None or div.near_tie, f"{what}, inserted: {div.describe()}"

    def test_generate_with_prefill(self, conformance):
        """generate_with_prefill (capability mixed_step) is prefill_batch and then generate
        in one call: two streams decode (one of them forced a token in that call) while the
        call prefills a whole prompt and, with prefix_reuse, continues a prefix, within the
        declared token count so that the engine mixes them into the step; the step's tokens,
        the prefixes (logits, first token, the prompt they hold) and their streams once
        inserted are the reference's, and the continued prefix is left as it was. An entry
        prefill would refuse refuses the call, which changes nothing. Undeclared, the method
        raises UnsupportedFeature or is absent."""
        eng = conformance.engine()
        d = conformance.driver(eng)
        mixed = getattr(eng, "generate_with_prefill", None)
        tokens = eng.capabilities.mixed_step
        if not tokens:
            if callable(mixed):
                with pytest.raises(UnsupportedFeature):
                    mixed(d.params, d.state, requests=[PrefillRequest(conformance.prompt(3, 131),
                                                                      conformance.sampling(131))])
            return
        assert callable(mixed), "mixed_step is declared but generate_with_prefill is missing"
        streams = _two_streams(conformance, d, 132)
        d.step(n=2)
        whole = conformance.prompt(min(tokens, 5), 134)
        entries = [("a whole prompt", whole, 0, conformance.sampling(134))]
        head = None
        if eng.capabilities.prefix_reuse and tokens > len(whole):  # a prefix continued inside the step
            cont = conformance.prompt(8 + min(tokens - len(whole), 3), 135)
            head, _ = d.prefill(cont[:8], conformance.sampling(136))
            head_logits = head.host_logits().copy()
            entries.append(("a continued prefix", cont, 8, conformance.sampling(137, temperature=0.0)))
        requests = [PrefillRequest(whole[start:], sampling, head if start else None)
                    for _, whole, start, sampling in entries]
        with pytest.raises(InvalidRequest):  # an id outside the vocabulary: refused before any work
            d.mixed_step([*requests, PrefillRequest([eng.vocab_size], conformance.sampling(138))])
        position = len(d.tokens[1]) - 1
        forced = {1: {position: streams[1][0][0]}}  # slot 1's latest token replaced in the same call
        done = d.mixed_step(requests, overrides={1: d.force(1, forced[1][position], position)})
        assert len(done) == len(requests), f"generate_with_prefill: {len(done)} results for {len(requests)} entries"
        oracle = conformance.oracle()
        for (what, whole, _, sampling), (prefix, first) in zip(entries, done):
            assert list(np.asarray(prefix.prompt_tokens)) == whole, (
                f"{what} in a mixed step: its prefix holds prompt {list(prefix.prompt_tokens)}, expected {whole}")
            conformance.within("logits_rel_l2", rel_l2(prefix.host_logits(), oracle.logits(whole)), conformance.dtype,
                               DEFAULT_MODEL, what=f"{what} in a mixed step: logits vs the reference's prefill")
            div = conformance.compare_to_oracle([int(first.tokens[0, 0])], whole, sampling,
                                                what=f"{what} in a mixed step: first token")
            assert div is None or div.near_tie, f"{what} in a mixed step: {div.describe()}"
        if head is not None:
            assert np.array_equal(head.host_logits(), head_logits), "a mixed step changed the prefix it continued"
        for slot, (_, whole, _, sampling), (prefix, first) in zip((2, 3), entries, done):
            d.insert_prefix(slot, prefix, first)
        d.step(n=3)
        for slot, (prompt, sampling) in streams.items():
            div = conformance.compare_to_oracle(d.tokens[slot], prompt, sampling, forced=forced.get(slot),
                                                what=f"slot {slot}, decoding through a mixed step")
            assert div is None or div.near_tie, f"slot {slot}, decoding through a mixed step: {div.describe()}"
        for slot, (what, whole, _, sampling) in zip((2, 3), entries):
            div = conformance.compare_to_oracle(d.tokens[slot], whole, sampling, what=f"{what}, inserted")
            assert div is None or div.near_tie, f"{what} from a mixed step, inserted: {div.describe()}"

    def test_page_rules(self, conformance):
        """docs/design.md, "Pages", on an engine that declares page_size: inserting shares
        pages, a shared page is copied before a write, free releases only the slot's
        references, a held page is never handed out again (conformance/pages.py)."""
        eng = conformance.engine()
        ps = eng.capabilities.page_size
        if not ps:
            pytest.skip("page_size is not declared: a contiguous cache has no page rules")
        n = min(ps + ps // 2, eng.max_prefill_length)
        if n <= ps:
            pytest.skip(f"pages of {ps} positions hold the longest prefix ({eng.max_prefill_length}) in one page")
        problems = page_rule_problems(eng, conformance.driver(eng).params, conformance.prompt(n, 95),
                                      conformance.prompt(5, 96))
        assert not problems, "page rules: " + "; ".join(problems)

    def test_prefix_reuse_at_bucket_edges(self, conformance):
        """Continuing a prefix is exact wherever the cut falls: prefixes of 1, 7, 8, 9, 15,
        16, 17 and 23 tokens (the edges of the buckets 8/16/24 and their neighbours)
        continued by one token and up to max_prefill_length, and whole prompts prefilled
        as chains of chunks of 4 and of 8 tokens (every intermediate prefix checked), on
        engines of every prefill-bucket variant; the continued prefix's stream, greedy
        and seeded (with a repetition penalty over the whole prompt where declared),
        equals the reference's."""
        if not conformance.capabilities.prefix_reuse:
            pytest.skip("prefix_reuse is not declared; its refusal is tested by test_prefix_reuse")
        dtype, limit = conformance.dtype, LIMITS["max_prefill_length"]
        whole = conformance.prompt(limit, 83)
        oracle = conformance.oracle()
        probe = conformance.sampling(83, temperature=0.0)
        edges = (1, 7, 8, 9, 15, 16, 17, limit - 1)
        for variant in VARIANTS:
            eng = conformance.engine(DEFAULT_MODEL, dtype, variant)
            d = conformance.driver(eng)
            buckets = VARIANTS[variant].get("prefill_buckets")
            where = f"prefill_buckets={buckets}" if buckets else "the backend's own prefill buckets"

            def check(prefix, first, end: int, what: str) -> None:
                assert list(np.asarray(prefix.prompt_tokens)) == whole[:end], (
                    f"{what}: the continued prefix holds prompt {list(prefix.prompt_tokens)}, expected the first "
                    f"{end} tokens")
                conformance.within("logits_rel_l2", rel_l2(prefix.host_logits(), oracle.logits(whole[:end])), dtype,
                                   DEFAULT_MODEL, what=f"{what} ({where}): logits vs the reference")
                div = conformance.compare_to_oracle([int(first.tokens[0, 0])], whole[:end], probe, what=what)
                assert div is None or div.near_tie, f"{what} ({where}): first token: {div.describe()}"

            for cut in edges:
                head, _ = d.prefill(whole[:cut], probe)
                for end in sorted({cut + 1, limit}):
                    tail, first = eng.prefill(params=d.params, tokens=whole[cut:end], sampling=probe, existing_prefix=head)
                    check(tail, first, end, f"a prefix of {cut} tokens continued to {end}")
            for chunk in (4, 8):
                prefix = None
                for start in range(0, limit, chunk):
                    end = min(start + chunk, limit)
                    prefix, first = eng.prefill(params=d.params, tokens=whole[start:end], sampling=probe,
                                                existing_prefix=prefix)
                    check(prefix, first, end, f"chunks of {chunk} tokens, the prefix after token {end}")
            self._streams_after_chunks(conformance, eng, whole, where)

    @staticmethod
    def _streams_after_chunks(conformance, eng, whole: list[int], where: str) -> None:
        """A prompt prefilled in chunks of 8 then decoded: greedy and seeded streams equal
        the reference's for the whole prompt (the penalty counts every chunk's tokens)."""
        penalty = {"repetition_penalty": 1.3} if conformance.declares("repetition_penalty") else {}
        for salt, sampling in ((84, conformance.sampling(84, temperature=0.0, **penalty)),
                               (85, conformance.sampling(85, **penalty))):
            d = conformance.driver(eng)
            prefix = None
            for start in range(0, len(whole), 8):
                prefix, first = eng.prefill(params=d.params, tokens=whole[start:start + 8], sampling=sampling,
                                            existing_prefix=prefix)
            d.insert_prefix(0, prefix, first)
            while len(d.tokens[0]) < 5:
                d.step()
            what = f"a prompt prefilled in chunks of 8 ({where}), then decoded with seed {sampling.seed}"
            div = conformance.compare_to_oracle(d.tokens[0][:5], whole, sampling, what=what)
            assert div is None or div.near_tie, f"{what}: {div.describe()}"

    def test_prefix_reuse_leaves_the_prefix(self, conformance):
        """Continuing a prefix leaves it as it was: continued twice with the same tokens it
        gives the same logits, with other tokens the reference's, and inserted afterwards
        it decodes as if never continued. Each continuation's first token and stream
        follow the continuing request's own parameters, never those the prefix was made
        with (a prefix cache shares one prefix between requests)."""
        if not conformance.capabilities.prefix_reuse:
            pytest.skip("prefix_reuse is not declared; its refusal is tested by test_prefix_reuse")
        eng, dtype = conformance.engine(), conformance.dtype
        d = conformance.driver(eng)
        oracle = conformance.oracle()
        head_prompt, head_sampling = conformance.prompt(9, 101), conformance.sampling(101)
        head, _ = d.prefill(head_prompt, head_sampling)
        kept = (list(np.asarray(head.prompt_tokens)), head.sampling, head.host_logits().copy())
        tails = {"greedy": (conformance.prompt(6, 102), conformance.sampling(102, temperature=0.0)),
                 "seeded": (conformance.prompt(6, 103), conformance.sampling(103, temperature=1.3))}
        runs = {}
        for name in ("greedy", "seeded", "greedy again"):
            tail, sampling = tails[name.split()[0]]
            prefix, first = eng.prefill(params=d.params, tokens=tail, sampling=sampling, existing_prefix=head)
            runs[name] = prefix
            whole = head_prompt + tail
            conformance.within("logits_rel_l2", rel_l2(prefix.host_logits(), oracle.logits(whole)), dtype,
                               DEFAULT_MODEL, what=f"the {name} continuation of one prefix vs the reference")
            div = conformance.compare_to_oracle([int(first.tokens[0, 0])], whole, sampling, what=f"{name} continuation")
            if div is not None and not div.near_tie:
                leaked = oracle.stream(whole, head_sampling, 1)[0]
                hint = (" (it is the token the prefix's own parameters draw: the continuation sampled with the "
                        "sampling of the prefix it continues)" if div.got == leaked.token else "")
                raise AssertionError(f"the {name} continuation's first token{hint}: {div.describe()}")
        conformance.within("bucket_rel_l2", rel_l2(runs["greedy again"].host_logits(), runs["greedy"].host_logits()),
                           dtype, what="one prefix continued twice with the same tokens (the second must equal the first)")
        assert list(np.asarray(head.prompt_tokens)) == kept[0] and head.sampling == kept[1], (
            "continuing a prefix changed its prompt tokens or its sampling parameters: a prefix stays as it was")
        conformance.within("bucket_rel_l2", rel_l2(head.host_logits(), kept[2]), dtype,
                           what="a prefix's logits after it was continued three times vs before")
        for slot, (prefix, prompt, sampling) in enumerate((
                (head, head_prompt, head_sampling),
                (runs["seeded"], head_prompt + tails["seeded"][0], tails["seeded"][1]))):
            d.insert_prefix(slot, prefix)
        while min(len(d.tokens[0]), len(d.tokens[1])) < 5:
            d.step()
        div = conformance.compare_to_oracle(d.tokens[0][:5], head_prompt, head_sampling,
                                            what="the prefix inserted after it was continued")
        assert div is None or div.near_tie, (
            f"a prefix inserted after it was continued decodes differently (continuing it changed it): {div.describe()}")
        div = conformance.compare_to_oracle(d.tokens[1][:5], head_prompt + tails["seeded"][0], tails["seeded"][1],
                                            what="a continued prefix inserted")
        assert div is None or div.near_tie, f"a continued prefix, inserted: {div.describe()}"

    def test_foreign_prefix_refused(self, conformance):
        """A prefix made with other weights (another model's engine of this backend) is
        refused by insert and as existing_prefix with InvalidRequest, before any change."""
        eng, other = conformance.engine(), conformance.engine(_OTHER_MODEL)
        d = conformance.driver(eng)
        foreign, _ = conformance.driver(other).prefill(conformance.prompt(5, 85), conformance.sampling(85))
        calls = [("insert", lambda: eng.insert(foreign, d.state, 0))]
        if eng.capabilities.prefix_reuse:
            calls.append(("prefill(existing_prefix=...)", lambda: eng.prefill(
                params=d.params, tokens=[3, 4], sampling=conformance.sampling(86), existing_prefix=foreign)))
        for what, call in calls:
            try:
                call()
            except InvalidRequest:
                continue
            except Exception as exc:
                raise AssertionError(
                    f"{what} with a prefix made by model {_OTHER_MODEL}'s engine raised {type(exc).__name__} ({exc}); "
                    f"expected InvalidRequest (compare the prefix's model_id with the engine's, EngineBase.check_prefix)"
                ) from None
            raise AssertionError(
                f"{what} accepted a prefix made with other weights (model {_OTHER_MODEL}): it must be refused with "
                f"InvalidRequest, not decoded into garbage"
            )
        d.insert(0, conformance.prompt(5, 87), conformance.sampling(87))
        assert d.step().valid[0].any(), "slot 0 produced no token after a refused foreign prefix"

    def test_portable_prefix_roundtrip(self, conformance):
        """export_prefix/import_prefix move a prefix between this backend and the
        reference in both directions (through the byte format); a portable prefix of
        another model is refused; undeclared (portable_prefix), both raise
        UnsupportedFeature."""
        eng = conformance.engine()
        dtype = conformance.dtype
        model = build_model(DEFAULT_MODEL)
        ref = reference_engine(model, conformance.harness.config("float64"))
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
                           dtype, what="exported K/V vs the reference's (K after rotate-half RoPE, no padding)")
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
        while len(d.tokens[0]) < 5:
            d.step()
        div = conformance.compare_to_oracle(d.tokens[0][:5], prompt, sampling, dtype=dtype,
                                            what="this backend continuing the reference's exported prefix")
        assert div is None or div.near_tie, f"this backend continuing a prefix exported by the reference: {div.describe()}"
        # a portable prefix of another model (same shapes or not) is refused
        other = build_model(_OTHER_MODEL)
        other_ref = reference_engine(other, conformance.harness.config("float64"))
        alien, _ = other_ref.prefill(params=other_ref.load_params(), tokens=prompt, sampling=sampling)
        try:
            eng.import_prefix(other_ref.export_prefix(alien))
        except InvalidRequest:
            pass
        except Exception as exc:
            raise AssertionError(f"import_prefix of model {_OTHER_MODEL}'s prefix raised {type(exc).__name__} ({exc}); "
                                 f"expected InvalidRequest (check the model fingerprint)") from None
        else:
            raise AssertionError(
                f"import_prefix accepted a portable prefix made by another model ({_OTHER_MODEL}): it must check the "
                f"prefix's model_fingerprint (PortablePrefix.check_compatible) and refuse it"
            )

    def _tail_case(self, conformance, seed: int):
        """The engine (capability portable_prefix_tail checked: undeclared, the method
        raises UnsupportedFeature or is absent; None then), its params, and a whole
        portable prefix of the longest prompt it takes (at most 24 tokens), made by the
        reference and read back from bytes."""
        eng = conformance.engine()
        d = conformance.driver(eng)
        if not eng.capabilities.portable_prefix_tail:
            if callable(getattr(eng, "import_prefix_tail", None)):
                own, _ = d.prefill(conformance.prompt(4, seed), conformance.sampling(seed))
                with pytest.raises(UnsupportedFeature):
                    eng.import_prefix_tail(eng.export_prefix(own) if eng.capabilities.portable_prefix else None,
                                           existing_prefix=own)
            return None, None, None
        ref = reference_engine(build_model(DEFAULT_MODEL), conformance.harness.config("float64"))
        prompt = conformance.prompt(min(24, eng.max_prefill_length), seed)
        made, _ = ref.prefill(params=ref.load_params(), tokens=prompt, sampling=conformance.sampling(seed))
        return eng, d.params, PortablePrefix.from_bytes(ref.export_prefix(made).to_bytes())

    def test_portable_prefix_tail(self, conformance):
        """import_prefix_tail (capability portable_prefix_tail) of a tail from position
        0, a page edge, inside a page and the prompt's end onto a prefix holding its
        head gives the whole prefix imported: K/V, prompt, logits, first token and the
        tokens of a few decode steps after insert, exactly; the head stays as it was
        (conformance/tails.py). Undeclared, the method raises UnsupportedFeature or is
        absent."""
        eng, params, whole = self._tail_case(conformance, 97)
        if eng is None:
            return
        problems = tail_import_problems(eng, params, whole, tail_starts(whole.true_length, eng.capabilities.page_size))
        assert not problems, "import_prefix_tail: " + "; ".join(problems)

    def test_portable_prefix_tail_refused(self, conformance):
        """import_prefix_tail refuses, with InvalidRequest: a head whose prompt ids differ
        from the tail's, a head shorter than the tail's start, a head made with other
        weights; a paged engine holds no more pages after the refusals."""
        eng, params, whole = self._tail_case(conformance, 98)
        if eng is None:
            return
        other = conformance.engine(_OTHER_MODEL)
        foreign, _ = conformance.driver(other).prefill(whole.prompt_tokens.tolist(), whole.sampling)
        problems = tail_refusal_problems(eng, params, whole, foreign)
        assert not problems, "import_prefix_tail refusals: " + "; ".join(problems)

    def test_portable_prefix_tail_shares_pages(self, conformance):
        """On an engine that declares page_size and portable_prefix_tail, importing a
        tail onto a prefix holding its head shares the head's full pages (no new page
        for them), copies a partly filled page before writing the tail into it, and
        leaves the head's K/V as they were (skipped on contiguous engines)."""
        ps = conformance.capabilities.page_size
        if not ps:
            pytest.skip("page_size is not declared: a contiguous cache has no pages to share")
        eng, params, whole = self._tail_case(conformance, 99)
        if eng is None:
            return
        if whole.true_length <= ps:
            pytest.skip(f"pages of {ps} positions hold the longest prompt ({whole.true_length}) in one page")
        problems = tail_sharing_problems(eng, params, whole)
        assert not problems, "import_prefix_tail page sharing: " + "; ".join(problems)

    def test_untrusted_portable_prefix_refused(self, conformance):
        """A portable prefix is untrusted data: NaN or infinite K/V or logits and prompt
        ids outside the vocabulary are refused by import_prefix with InvalidRequest
        (EngineBase.check_portable), never decoded into garbage; the engine goes on."""
        eng = conformance.engine()
        if not eng.capabilities.portable_prefix:
            return  # test_portable_prefix_roundtrip checks the UnsupportedFeature
        model = build_model(DEFAULT_MODEL)
        ref = reference_engine(model, conformance.harness.config("float64"))
        prompt, sampling = conformance.prompt(6, 93), conformance.sampling(93)
        good = ref.export_prefix(ref.prefill(params=ref.load_params(), tokens=prompt, sampling=sampling)[0])

        def spoiled(name: str, value: float) -> PortablePrefix:
            bad = PortablePrefix.from_bytes(good.to_bytes())
            arr = {"k": bad.k, "v": bad.v, "logits": bad.last_logits, "prompt": bad.prompt_tokens}[name]
            arr.flat[arr.size // 2] = value
            return bad

        cases = [("NaN in K", spoiled("k", np.nan)), ("+inf in V", spoiled("v", np.inf)),
                 ("NaN in the last logits", spoiled("logits", np.nan)),
                 ("-inf in the last logits", spoiled("logits", -np.inf)),
                 (f"a prompt id {model.config.vocab_size} (outside the vocabulary)",
                  spoiled("prompt", model.config.vocab_size))]
        for what, bad in cases:
            try:
                eng.import_prefix(bad)
            except InvalidRequest:
                continue
            except Exception as exc:
                raise AssertionError(f"import_prefix of a prefix with {what} raised {type(exc).__name__} ({exc}); "
                                     f"expected InvalidRequest (EngineBase.check_portable)") from None
            raise AssertionError(f"import_prefix accepted a portable prefix with {what}: it must be refused with "
                                 f"InvalidRequest (EngineBase.check_portable), not decoded into garbage")
        d = conformance.driver(eng)
        d.insert_prefix(0, eng.import_prefix(good))
        assert d.step().valid[0].any(), "slot 0 produced no token from a good prefix after refusing bad ones"

    def test_config_refusals(self, conformance):
        """Building an engine refuses, before allocating: an option it does not declare
        (InvalidRequest or UnsupportedFeature), a max_cache_length beyond the model's
        positions (InvalidRequest), and caches or weights that do not fit in memory
        (InsufficientMemory, checked with polyengine.memory under a simulated limit)."""
        harness = conformance.harness
        model = build_model(harness.default_model)  # another where the run's options refuse the default
        dtype = conformance.dtype
        cases = [
            ("an unknown option", harness.config(dtype, options={**harness.options, "polyengine_conformance_no_such_option": 1}),
             (InvalidRequest, UnsupportedFeature)),
            (f"max_cache_length {model.config.max_position_embeddings + 1} (> the model's max_position_embeddings)",
             harness.config(dtype, max_cache_length=model.config.max_position_embeddings + 1), (InvalidRequest,)),
        ]
        for what, config, errors in cases:
            try:
                harness.build(model, config)
            except errors:
                continue
            except Exception as exc:
                raise AssertionError(f"building an engine with {what} raised {type(exc).__name__} ({exc}); expected "
                                     f"{' or '.join(e.__name__ for e in errors)}") from None
            raise AssertionError(f"the factory built an engine with {what}: it must refuse it (EngineBase.__init__ does)")
        with simulated_limit(1 << 20):
            try:
                harness.build(model, harness.config(dtype))
            except InsufficientMemory:
                return
            except Exception as exc:
                raise AssertionError(f"with 1 MiB of memory available, building an engine raised {type(exc).__name__} "
                                     f"({exc}); expected InsufficientMemory") from None
        raise AssertionError(
            "with 1 MiB of memory available (polyengine.memory.simulated_limit), the factory built an engine: an engine "
            "must check what it will allocate (weights, KV caches) with polyengine.memory.check_fits "
            "(EngineBase.check_memory) before allocating, on the host or its device"
        )
