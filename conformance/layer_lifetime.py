"""Layer 3, lifetime: every object the protocol hands out, used again after each later event.

The contract and differential layers check a prefix when it is first used; a backend
can keep it right until something happens to it later: the slot it went into is freed
(what the driver's prefix cache does on every hit: the request ends, the cached prefix
is inserted again), that slot takes another request, other slots run, the prefix is
continued, exported, or other prefixes are imported. docs/design.md (Prefixes) says
none of that may change a prefix. This layer walks the table :data:`OBJECTS` x
:data:`EVENTS`: make the object, let the event happen, then use the object every way
the protocol allows (:func:`_use`: its logits and prompt as made; inserted into a slot
it never went into and decoded; bulk-inserted; continued; exported), each use compared
with the reference. docs/conformance.md shows the table with the broken backend each
cell catches.

Decode states are the protocol's other returned objects; their later uses (a freed
slot behaves as fresh, a refused call changes nothing, a result read after the next
step) are the contract layer's and the differential layer's (docs/conformance.md,
"Lifetimes").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from polyengine.prefix import PortablePrefix

from polyengine.conformance import layer
from polyengine.conformance.models import DEFAULT_MODEL, build_model
from polyengine.conformance.oracle import reference_engine
from polyengine.conformance.stats import rel_l2

__all__ = ["OBJECTS", "EVENTS", "USES"]

# How the object is made, and the capability that needs (None: every backend).
OBJECTS = {
    "prefill": ("a prefill's Prefix", None),
    "continuation": ("a continuation's Prefix (prefill with existing_prefix)", "prefix_reuse"),
    "import": ("an imported Prefix (import_prefix of the reference's export)", "portable_prefix"),
}
# What happens between the object's making and its later uses, and the capability it needs.
EVENTS = {
    "later_prefills": ("two more prefills ran", None),
    "inserted": ("it was inserted into slot 0, which stays occupied", None),
    "slot_generated": ("it was inserted into slot 0, which ran 4 steps and stays occupied", None),
    "slot_freed": ("it was inserted into slot 0, which ran 2 steps and was freed", None),
    "slot_reused": ("it was inserted into slot 0, which ran 2 steps, was freed and took another request that ran "
                    "3 steps", None),
    "continued": ("it was continued twice (a continuation's base continued again too)", "prefix_reuse"),
    "exported": ("it was exported", "portable_prefix"),
    "imported_again": ("two other portable prefixes were imported", "portable_prefix"),
    "other_slots": ("other requests were inserted into slots 1 and 2, ran, freed and inserted again", None),
}
# The later uses, each compared with the reference (the capability each needs).
USES = {
    "as made": None,  # prompt tokens and host_logits() unchanged
    "inserted": None,  # into slot 3, never used before, and decoded 4 tokens
    "bulk_inserted": "bulk_insert",  # samples 0 and 1 into slots 2 and 1, 3 tokens each
    "continued": "prefix_reuse",  # prefill(existing_prefix=...): logits and first token
    "exported": "portable_prefix",  # K/V and last logits
}
_TOKENS = 4  # tokens compared per inserted request


@dataclass
class _Made:
    prefix: Any
    prompt: list[int]
    sampling: Any
    base: Any = None  # a continuation's base prefix


def _reference_export(conformance, prompt: list[int], sampling) -> PortablePrefix:
    """The reference's export of ``prompt`` (what an import is made from), through bytes."""
    key = ("lifetime-reference", DEFAULT_MODEL)
    if key not in conformance.harness.cache:
        ref = reference_engine(build_model(DEFAULT_MODEL), conformance.harness.config("float64"))
        conformance.harness.cache[key] = (ref, ref.load_params())
    ref, params = conformance.harness.cache[key]
    prefix, _ = ref.prefill(params=params, tokens=prompt, sampling=sampling)
    return PortablePrefix.from_bytes(ref.export_prefix(prefix).to_bytes())


def _sampling(conformance, salt: int):
    """Seeded, with a repetition penalty where declared: a stream that depends on the
    step counter and on every token seen, so a prefix that carries a slot's progress shows."""
    extra = {"repetition_penalty": 1.4} if conformance.declares("repetition_penalty") else {}
    return conformance.sampling(salt, temperature=1.1, **extra)


def _make(conformance, d, obj: str) -> _Made:
    eng = d.engine
    if obj == "prefill":
        prompt, sampling = conformance.prompt(7, 301), _sampling(conformance, 301)
        return _Made(d.prefill(prompt, sampling)[0], prompt, sampling)
    if obj == "continuation":
        head, tail, sampling = conformance.prompt(5, 302), conformance.prompt(4, 303), _sampling(conformance, 303)
        base, _ = d.prefill(head, _sampling(conformance, 302))
        prefix, _ = eng.prefill(params=d.params, tokens=tail, sampling=sampling, existing_prefix=base)
        return _Made(prefix, head + tail, sampling, base)
    prompt, sampling = conformance.prompt(7, 304), _sampling(conformance, 304)
    return _Made(eng.import_prefix(_reference_export(conformance, prompt, sampling)), prompt, sampling)


def _happen(conformance, d, made: _Made, event: str) -> None:
    """Let ``event`` happen to the object (on the backend's driver ``d``)."""
    eng = d.engine
    other = lambda salt, n: (conformance.prompt(n, salt), _sampling(conformance, salt))  # noqa: E731
    if event == "later_prefills":
        for salt, n in ((311, 11), (312, 3)):
            d.prefill(*other(salt, n))
    elif event in ("inserted", "slot_generated", "slot_freed", "slot_reused"):
        d.insert_prefix(0, made.prefix)
        if event != "inserted":
            d.step(n=4 if event == "slot_generated" else 2)
        if event in ("slot_freed", "slot_reused"):
            d.free(0)
        if event == "slot_reused":
            d.insert(0, *other(313, 9))
            d.step(n=3)
    elif event == "continued":
        for salt, n in ((314, 3), (315, 5)):
            eng.prefill(params=d.params, tokens=conformance.prompt(n, salt), sampling=_sampling(conformance, salt),
                        existing_prefix=made.prefix)
        if made.base is not None:
            eng.prefill(params=d.params, tokens=conformance.prompt(4, 316), sampling=_sampling(conformance, 316),
                        existing_prefix=made.base)
    elif event == "exported":
        eng.export_prefix(made.prefix).to_bytes()
    elif event == "imported_again":
        for salt, n in ((317, 9), (318, 6)):
            eng.import_prefix(_reference_export(conformance, *other(salt, n)))
    elif event == "other_slots":
        d.insert(1, *other(319, 8))
        d.insert(2, *other(320, 5))
        d.step(n=3)
        d.free(1)
        d.insert(1, *other(321, 6))
        d.step(n=2)
    else:  # pragma: no cover - a suite bug
        raise KeyError(event)


def _use(conformance, d, made: _Made, what: str, *, in_slot_0: bool) -> None:
    """Every later use of the object the protocol allows, each against the reference
    (``in_slot_0``: the event left it decoding in slot 0, which is judged too)."""
    eng, dtype, caps = d.engine, conformance.dtype, d.engine.capabilities
    oracle = conformance.oracle()
    prompt, sampling = made.prompt, made.sampling
    got = [int(t) for t in np.asarray(made.prefix.prompt_tokens)]
    assert got == prompt, f"{what}: its prompt_tokens are {got}, it was made from {prompt}"
    conformance.within("logits_rel_l2", rel_l2(np.asarray(made.prefix.host_logits(), np.float64), oracle.logits(prompt)),
                       dtype, DEFAULT_MODEL, what=f"{what}: its host_logits() vs the reference's")

    def judge(tokens, sample_index: int, how: str) -> None:
        div = conformance.compare_to_oracle(tokens, prompt, sampling, sample_index=sample_index, what=f"{what}, {how}")
        if div is not None and not div.near_tie:
            raise AssertionError(f"{what}, {how}: {div.describe()} (a Prefix stays valid and unchanged for the "
                                 f"engine's life, whatever later calls do: docs/design.md, Prefixes)")

    for slot in sorted(d.live - ({0} if in_slot_0 else set())):
        d.free(slot)
    d.insert_prefix(3, made.prefix)
    while len(d.tokens[3]) < _TOKENS:
        d.step()
    judge(d.tokens[3][:_TOKENS], 0, "then inserted into slot 3 (never used before) and decoded")
    if in_slot_0:
        judge(d.tokens[0][:_TOKENS], 0, "its first insert, in slot 0, decoded beside it")
    if caps.bulk_insert:
        for slot in (1, 2):
            if slot in d.live:
                d.free(slot)
        d.bulk_insert([2, 1], made.prefix)
        while min(len(d.tokens[2]), len(d.tokens[1])) < _TOKENS - 1:
            d.step()
        for i, slot in enumerate((2, 1)):
            judge(d.tokens[slot][: _TOKENS - 1], i, f"then bulk_insert(slots=[2, 1]): sample {i} in slot {slot}")
    if caps.prefix_reuse:
        tail, tail_sampling = conformance.prompt(3, 330), conformance.sampling(330, temperature=0.0)
        cont, first = eng.prefill(params=d.params, tokens=tail, sampling=tail_sampling, existing_prefix=made.prefix)
        conformance.within("logits_rel_l2", rel_l2(np.asarray(cont.host_logits(), np.float64), oracle.logits(prompt + tail)),
                           dtype, DEFAULT_MODEL, what=f"{what}, then continued with {len(tail)} tokens: the logits")
        div = conformance.compare_to_oracle([int(first.tokens[0, 0])], prompt + tail, tail_sampling,
                                            what=f"{what}, then continued")
        if div is not None and not div.near_tie:
            raise AssertionError(f"{what}, then continued: the first token: {div.describe()}")
    if caps.portable_prefix:
        out = PortablePrefix.from_bytes(eng.export_prefix(made.prefix).to_bytes())
        want_k, want_v = oracle.kv(prompt)
        err = max(rel_l2(out.k.ravel(), want_k.ravel()), rel_l2(out.v.ravel(), want_v.ravel())) \
            if out.k.shape == want_k.shape else float("inf")
        conformance.within("kv_rel_l2", err, dtype, DEFAULT_MODEL, what=f"{what}, then exported: K/V (shape "
                           f"{out.k.shape}, the reference's {want_k.shape}) vs the reference's")


@layer("lifetime")
class LifetimeLayer:
    @pytest.mark.parametrize("event", list(EVENTS))
    @pytest.mark.parametrize("obj", list(OBJECTS))
    def test_prefix_lifetime(self, conformance, obj, event):
        """An object the protocol returned (a prefill's, a continuation's or an imported
        Prefix), after a later event (more prefills; inserted; its slot ran, was freed,
        was reused; continued; exported; other imports; other slots' traffic), is still
        the reference's in every later use: its logits, inserted into a fresh slot and
        decoded (penalized seeded stream), bulk-inserted, continued, exported."""
        caps = conformance.capabilities
        for name, need in (("object", OBJECTS[obj][1]), ("event", EVENTS[event][1])):
            if need is not None and not getattr(caps, need):
                pytest.skip(f"{need} is not declared (this {name} needs it); its refusal is tested by the contract layer")
        eng = conformance.engine()
        d = conformance.driver(eng)
        made = _make(conformance, d, obj)
        _happen(conformance, d, made, event)
        _use(conformance, d, made, f"{OBJECTS[obj][0]}, after {EVENTS[event][0]}",
             in_slot_0=event in ("inserted", "slot_generated"))
