"""Random programs of protocol calls, run on the backend and on the reference.

A program (:class:`Program`, Hypothesis' ``RuleBasedStateMachine`` with one rule) is a
sequence of steps, each one call drawn with weights (:attr:`Program.CALLS`) and its
arguments made by :class:`~polyengine.conformance.program_draws.Draw` from the step's
seed: start a request as the driver does (prefill, then insert or bulk_insert), prefill
ahead (with and without ``existing_prefix``), insert a kept prefix (again: reuse),
bulk_insert, generate (results read at once or after the next step is dispatched),
generate with overrides, free_resource, export_prefix, import_prefix, and refused calls
mixed in (bad, occupied or repeated slots, bad overrides beside good ones, too long or
empty prompts, ids outside the vocabulary, undeclared parameters and features, prefixes
of other weights). On an engine that declares ``token_masks``, prefills and generate
steps carry allowed-token masks now and then, and refused masks are mixed in
(:mod:`polyengine.conformance.program_masks`).

Every call runs on the backend and on a **mirror**: the reference engine restricted to
the backend's declared capabilities (:func:`polyengine.conformance.oracle.mirror_engine`),
which receives the same slot and prefix calls but never generates. Where one refuses a
call the other must refuse it too, with the same error type (or a subclass), and a
refused call changes nothing: the program's model of the slots stays as it was, and
every later output is still compared. The values are judged by
:class:`~polyengine.conformance.program_checks.Judge` against the oracle, per request.

The program keeps a log in the protocol's own calls, annotated with what the backend
returned; a failure's message ends with it, so it can be replayed by hand.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from polyengine.engine import Override, Prefix, PrefillRequest
from polyengine.errors import InsufficientMemory, PolyengineError
from polyengine.prefix import PortablePrefix
from polyengine.sampling import SamplingParams

from polyengine.conformance.program_checks import Judge, Pending, ProgramFailure, SlotTrack
from polyengine.conformance.program_draws import (GENERATE_MASK_REFUSALS, PREFILL_MASK_REFUSALS, STEPS_PER_GENERATE, Dims,
                                                  Draw, MaskDraw, show, show_mask)
from polyengine.conformance.program_masks import MaskCalls
from polyengine.conformance.stats import rel_l2

__all__ = ["ProgramRun", "Program", "ProgramFailure"]


# -- what the program knows ----------------------------------------------------------------------


@dataclass
class PrefixEntry:
    label: str
    backend: Prefix
    mirror: Prefix
    prompt: tuple[int, ...]
    sampling: SamplingParams
    first: int  # sample 0's first token, as the backend drew it
    diverged: bool  # sample 0's first token left the reference's (a near tie): not compared
    prefills_at: int  # prefills the program had run when this prefix was made
    inserts: int = 0  # insert and bulk_insert calls that took it
    mask: np.ndarray | None = None  # the allowed-token mask its first tokens are drawn under
    tags: frozenset[str] = frozenset()  # composed capabilities its requests carry (continuation, import)


@dataclass
class PortableEntry:
    label: str
    data: bytes  # the backend's export, serialized
    prompt: tuple[int, ...]


@dataclass
class ProgramRun:
    """Everything one differential test shares across its programs: the backend's engine,
    the mirror, the oracle, the tolerances, and the log of the program running now."""

    context: Any  # polyengine.conformance.harness.Context
    engine: Any
    params: Any
    mirror: Any
    mirror_params: Any
    oracle: Any  # a ReferenceOracle of this program's own (its cache is cleared per program)
    model: str
    dtype: str
    describe: str  # the configuration, for messages
    foreign: Callable[[], tuple[Prefix, Prefix, PortablePrefix]]  # another model's prefixes and export
    dims: Dims = field(init=False)
    log: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # what the programs compared, for the report
    pairs: dict[str, int] = field(default_factory=dict)  # "a + b" -> tokens compared in requests combining both
    first_failure: tuple[str, list[str]] | None = None  # the first failing program's message and log
    _kept: tuple[Any, Any] | None = None  # the last good program's decode states (backend, mirror)
    # A bounded page pool too small for the programs (test_programs_under_page_pressure):
    # a call the backend refuses with InsufficientMemory is not run on the mirror (its cache
    # is contiguous), so the programs go on against a reference that never made it.
    # ``rebuild`` (set only then) makes a new engine of the same configuration (:meth:`_drained`).
    rebuild: Callable[[], Any] | None = None

    @property
    def pressure(self) -> bool:
        return self.rebuild is not None

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    def fresh_states(self) -> tuple[Any, Any]:
        """The decode states a program starts from: those of the last program that ended
        well, every slot freed (a freed slot behaves as a fresh one, so this costs the
        backend no allocation and checks reuse across programs too), else new ones (after
        a failure, or the first time: a broken state must not spoil the shrinking)."""
        states, self._kept = self._kept, None
        if self.pressure:
            states = self._drained(states)
        if states is None:
            return self.engine.init_decode_state(), self.mirror.init_decode_state()
        state, mstate = states
        for slot in range(self.dims.slots):
            state = self.engine.free_resource(state, slot)
            mstate = self.mirror.free_resource(mstate, slot)
        return state, mstate

    def _drained(self, states: tuple[Any, Any] | None) -> tuple[Any, Any] | None:
        """Under page pressure every program starts from an empty pool, so that a seeded
        program runs the same when Hypothesis runs it again: the last program's prefixes
        collected (its teardown let go of them) and its slots freed; where pages are still
        held (a failed program's, which its traceback keeps), on a new engine."""
        gc.collect()
        if states is not None:
            state = states[0]
            for slot in range(self.dims.slots):
                state = self.engine.free_resource(state, slot)
            states = (state, states[1])
        if self.engine.pages.held == 0:
            return states
        self.engine = self.rebuild()
        self.params = self.engine.load_params()
        return None

    def keep_states(self, state: Any, mstate: Any) -> None:
        self._kept = (state, mstate)

    def __post_init__(self) -> None:
        e, caps = self.engine, self.engine.capabilities
        self.dims = Dims(
            vocab=int(e.vocab_size), slots=int(e.max_concurrent_decodes), max_prefill=int(e.max_prefill_length),
            max_cache=int(e.max_cache_length), tokens_per_step=int(caps.tokens_per_step),
            eos=tuple(int(t) for t in self.oracle.eos_token_ids), declared=frozenset(caps.sampling_params),
            max_top_logprobs=int(caps.max_top_logprobs), bulk_insert=bool(caps.bulk_insert),
            portable_prefix=bool(caps.portable_prefix), prefix_reuse=bool(caps.prefix_reuse),
            token_masks=bool(getattr(caps, "token_masks", False)),
            prefill_lane=bool(getattr(caps, "prefill_lane", False)),
            mixed_step=int(getattr(caps, "mixed_step", 0) or 0),
        )
        ctx = self.context
        self.tol = {q: ctx.tolerance(q, self.dtype, self.model).value
                    for q in ("tie_gap", "logprob_abs", "logits_rel_l2", "kv_rel_l2", "support_slack")}


# -- the machine ---------------------------------------------------------------------------------


class Program(Judge, MaskCalls, RuleBasedStateMachine):
    """One random program: each rule is one protocol call (or a few generate steps) run
    on the backend and the mirror, its outputs compared with the oracle's."""

    def __init__(self, run: ProgramRun):
        super().__init__()
        self.run, self.d = run, run.dims
        run.log = [f"state = engine.init_decode_state()  # {run.describe} (programs reuse one state, every slot freed)"]
        run.oracle.clear()
        self.state, self.mstate = run.fresh_states()
        self.prefixes: list[PrefixEntry] = []
        self.portables: list[PortableEntry] = []
        self.slots: dict[int, SlotTrack] = {}
        self.pending: list[Pending] = []
        self.prefills = 0
        self.refused = 0
        self.failed = False
        self.emptied = False  # a slot was freed: generate on an empty state is worth a look then

    # -- running a call on both ----------------------------------------------------------------

    def _both(self, at: int, backend: Callable[[], Any], mirror: Callable[[], Any]) -> tuple[Any, Any] | None:
        """Run a call on the backend and on the mirror: both results, or None when both
        refused it with the same error type; anything else fails the program."""
        try:
            got, got_exc = backend(), None
        except Exception as exc:  # the backend's verdict, judged against the reference's below
            got, got_exc = None, exc
        if self._out_of_pages(at, got_exc):
            return None
        try:
            want, want_exc = mirror(), None
        except PolyengineError as exc:
            want, want_exc = None, exc
        what = self.run.log[at].split("  #")[0].strip()
        if got_exc is None and want_exc is None:
            return got, want
        if got_exc is not None and want_exc is not None:
            if isinstance(got_exc, type(want_exc)):
                self.refused += 1
                self.run.count("refusals compared")
                self._annotate(at, f"refused: {type(got_exc).__name__}")
                return None
            self._annotate(at, f"raised {type(got_exc).__name__}")
            self._fail(f"`{what}` raised {type(got_exc).__name__} ({got_exc}); the reference refuses this call with "
                       f"{type(want_exc).__name__} ({want_exc}): a refusal must have the protocol's error type "
                       f"(docs/design.md, Refusals)")
        if want_exc is not None:
            self._annotate(at, "accepted")
            self._fail(f"`{what}` was accepted; the reference refuses it with {type(want_exc).__name__}: {want_exc}")
        self._annotate(at, f"raised {type(got_exc).__name__}")
        self._fail(f"`{what}` raised {type(got_exc).__name__}: {got_exc}; the reference accepts this call")
        return None  # unreachable

    def _out_of_pages(self, at: int, exc: BaseException | None) -> bool:
        """Under page pressure (ProgramRun.pressure), whether the backend refused call
        ``at`` for want of pages: recorded as a refusal, which must have changed nothing
        (every later comparison checks it); the mirror is not given the call."""
        if not (self.run.pressure and isinstance(exc, InsufficientMemory)):
            return False
        self.refused += 1
        self.run.count("page refusals")
        self._annotate(at, "refused: InsufficientMemory (the page pool)")
        return True

    # -- the calls ----------------------------------------------------------------------------

    # The calls a program makes, with their weights. One Hypothesis rule draws them (a
    # rule per call would be picked by Hypothesis' "swarm" selection, which turns most of
    # a small budget into programs of one call kind); shrinking goes towards the first.
    # A call that is not possible yet (an insert before any prefill) does nothing.
    CALLS = tuple(name for name, weight in (
        ("start_request", 4), ("generate", 5), ("generate_with_overrides", 3), ("prefill", 2), ("insert", 3),
        ("free", 2), ("bulk_insert", 1), ("export", 1), ("import_prefix", 1), ("prefill_refused", 1), ("chain", 4),
    ) for _ in range(weight))

    @rule(call=st.sampled_from(CALLS), seed=st.integers(0, (1 << 32) - 1))
    def step(self, call: str, seed: int) -> None:
        getattr(self, call)(Draw(seed))

    def start_request(self, draw: Draw) -> None:
        """What the driver does: prefill a request, then insert it into a free slot (or
        bulk_insert its n samples into n free slots)."""
        d = self.d
        sampling = draw.sampling(d)
        prompt = draw.tokens(d, 1, d.max_prefill)
        order = draw.order(d.slots)
        mask = draw.mask(d) if d.token_masks and draw.chance(0.3) else None
        entry = self._prefill(prompt, sampling, None, mask)
        free = [s for s in order if s not in self.slots]
        if entry is None or not free:
            return
        if sampling.n > 1 and d.bulk_insert and len(free) >= sampling.n:
            self._bulk_insert(entry, free[: sampling.n])
        else:
            self._insert(entry, free[0])

    def chain(self, draw: Draw) -> None:
        """Calls that combine capabilities, as a prefix cache, ``n`` samples and a grammar
        do together: a request continuing a kept prefix (an imported one too), under a
        mask where declared; its samples bulk-inserted (or inserted); a step forcing
        tokens, with masks; one of its slots freed and its prefix inserted again (the
        prefix cache's hit); more steps, masked at times. The layer counts which pairs of
        capabilities (:data:`~polyengine.conformance.program_checks.COMPOSED`) each
        configuration's compared tokens combined."""
        d = self.d
        sampling = draw.sampling(d)
        index, order, which = draw.index(), draw.order(d.slots), draw.index()
        continued, masked, bulk = draw.chance(0.8), draw.chance(0.6), draw.chance(0.6)
        base = self.prefixes[index % len(self.prefixes)] if d.prefix_reuse and self.prefixes and continued else None
        if base is not None and len(base.prompt) >= d.max_prefill:
            base = None
        room = d.max_prefill - (len(base.prompt) if base else 0)
        prompt = draw.tokens(d, 1, max(1, min(room, 8)))
        mask = draw.mask(d) if d.token_masks and masked else None
        entry = self._prefill(prompt, sampling, base, mask)
        free = [s for s in order if s not in self.slots]
        if entry is None or not free:
            return
        bulk = d.bulk_insert and bulk and len(free) >= 2
        if bulk:
            self._bulk_insert(entry, free[:2])
        else:
            self._insert(entry, free[0])
        self.generate_with_overrides(draw)
        ours = sorted(s for s, t in self.slots.items() if t.origin.startswith(f"request {entry.label} in slot "))
        if ours:
            self._free(ours[which % len(ours)])
            free = [s for s in order if s not in self.slots]
            if free and d.bulk_insert and not bulk:  # inserted first: the prefix's samples again, by bulk_insert
                self._bulk_insert(entry, free[:1])
            elif free:
                self._insert(entry, free[0])
        steps = draw.integer(1, 3)
        self._steps(steps, draw.chance(0.5), draw.step_masks(d, steps))

    def prefill(self, draw: Draw) -> None:
        """A prefill whose prefix is kept for later (prefill ahead), maybe continuing one
        (``existing_prefix``; without ``prefix_reuse`` a refusal, then drawn less often)."""
        d = self.d
        sampling = draw.sampling(d)
        continued = draw.chance(0.4 if d.prefix_reuse else 0.1)
        index = draw.index()
        base = self.prefixes[index % len(self.prefixes)] if continued and self.prefixes else None
        room = d.max_prefill - (len(base.prompt) if base else 0)
        prompt = draw.tokens(d, 1, max(1, room))
        mask = draw.mask(d) if d.token_masks and draw.chance(0.3) else None
        self._prefill(prompt, sampling, base, mask)

    def prefill_refused(self, draw: Draw) -> None:
        """A prefill the protocol refuses: a bad prompt, a bad id in the parameters,
        ``existing_prefix`` pushing the prompt past ``max_prefill_length``, or (half of
        them, where ``token_masks`` is declared) a good prompt with a bad mask."""
        d = self.d
        kinds = ["empty prompt", "prompt too long", "token id = vocab_size", "token id -1", "logit_bias id = vocab_size",
                 "existing_prefix makes it too long"]
        kind = draw.choice(kinds)
        prompt = draw.tokens(d, 1, d.max_prefill)
        sampling = SamplingParams(seed=draw.seed())
        over, at, index = draw.integer(1, 3), draw.index(), draw.index()
        refusal = draw.mask_refusal(d, PREFILL_MASK_REFUSALS, 0.5)
        if refusal is not None:
            words, sampling, kind = self._refused_prefill_mask(refusal, sampling)
            self._prefill(prompt, sampling, None, words)
            self._fail_if_accepted(len(self.run.log) - 1, f"a token mask the protocol refuses ({kind})")
            self.run.count("mask refusals compared")
            return
        if kind == kinds[-1] and not self.prefixes:
            kind = kinds[1]
        base = None
        if kind == "empty prompt":
            prompt = []
        elif kind == "prompt too long":
            prompt = (prompt * (d.max_prefill + 1))[: d.max_prefill + over]
        elif kind == "token id = vocab_size":
            prompt[at % len(prompt)] = d.vocab
        elif kind == "token id -1":
            prompt[at % len(prompt)] = -1
        elif kind == "logit_bias id = vocab_size":
            sampling = sampling.model_copy(update={"logit_bias": {d.vocab: 1.0}})
        else:
            base = self.prefixes[index % len(self.prefixes)]
            prompt = (prompt * d.max_prefill)[: d.max_prefill - len(base.prompt) + 1]
        self._prefill(prompt, sampling, base)

    def _prefill(self, prompt: list[int], sampling: SamplingParams, base: PrefixEntry | None,
                 mask: MaskDraw | np.ndarray | None = None, *, mixed: tuple[Callable[..., Any], str] | None = None
                 ) -> PrefixEntry | None:
        """Prefill on both (``mask``: a drawn mask, fitted to the first token here, or
        the words of a refused one), then compare the prefix and the first token.
        ``mixed``: the backend's side is this generate_with_prefill call (:meth:`_mixed`),
        with the step's masks as shown."""
        run = self.run
        self._read_pending()
        label = f"P{len(self.prefixes)}"
        notes = self._prefix_notes(base) if base else []
        full = tuple((base.prompt if base else ()) + tuple(int(t) for t in prompt))
        if isinstance(mask, MaskDraw):
            mask = self._fit_mask(mask, full, [], sampling, 0)
        masked = {} if mask is None else {"token_mask": mask}  # no keyword at all without a mask
        extra = (f", existing_prefix={base.label}" if base else "") + (
            f", token_mask={show_mask(mask, self.d.vocab)}" if mask is not None else "")
        # Every other prefill of an engine with a prefill lane runs there (start_prefill,
        # awaited): its prefixes then meet every later call of the program.
        lane = self.d.prefill_lane and self.prefills % 2 == 1 and mixed is None
        if mixed is not None:
            call, done, prefill = "engine.generate_with_prefill", "", mixed[0]
            entry = f"PrefillRequest(tokens={prompt}, sampling={show(sampling)}{extra})"
            at = self._say(f"state, r{len(run.log)}, F = {call}(params, state, requests=[{entry}]"
                           f"{mixed[1]}); {label}, r = F.result()[0]")
        else:
            call, done = ("engine.start_prefill", ".result()") if lane else ("engine.prefill", "")
            prefill = (lambda **kw: run.engine.start_prefill(**kw).result(timeout=600)) if lane else run.engine.prefill
            at = self._say(f"{label}, r = {call}(params=params, tokens={prompt}, sampling={show(sampling)}{extra}){done}")
        out = self._both(
            at,
            lambda: prefill(params=run.params, tokens=list(prompt), sampling=sampling,
                            existing_prefix=base.backend if base else None, **masked),
            lambda: run.mirror.prefill(params=run.mirror_params, tokens=list(prompt), sampling=sampling,
                                       existing_prefix=base.mirror if base else None, **masked),
        )
        if out is not None and base is not None:
            self._used(base, "continued")
        if out is not None and lane:
            run.count("prefills on the lane")
        self.prefills += 1
        if out is None:
            return None
        (prefix, result), (mprefix, _) = out
        if mask is not None:
            run.count("prefill masks")
            if base is not None:
                run.count("prefill masks continuing a prefix")
        where = f"`{label}, r = {call}(...){done}`"
        got_prompt = tuple(int(t) for t in np.asarray(prefix.prompt_tokens))
        if got_prompt != full:
            self._fail(f"{where}: the prefix holds prompt {list(got_prompt)}, expected {list(full)}"
                       + (f" ({base.label}'s prompt, then the new tokens)" if base else ""))
        tokens, valid, lengths = np.asarray(result.tokens), np.asarray(result.valid, bool), np.asarray(result.lengths)
        if tokens.shape[0] != 1 or not valid[0, 0] or valid[0].sum() != 1 or lengths.tolist() != [1]:
            self._fail(f"{where}: the result must hold one row with one valid token and lengths [1]; got tokens "
                       f"{tokens.tolist()}, valid {valid.tolist()}, lengths {lengths.tolist()}")
        first = int(tokens[0, 0])
        if int(prefix.first_token) != first:
            self._fail(f"{where}: Prefix.first_token is {int(prefix.first_token)} but the result's token is {first}")
        logits = run.oracle.logits(list(full))
        err = rel_l2(np.asarray(prefix.host_logits(), np.float64), logits)
        self._within("logits_rel_l2", err, f"{where}: Prefix.host_logits() vs the reference's logits for its prompt"
                     + (f" (continuing {base.label})" if base else ""), notes)
        track = SlotTrack(label, full, sampling, 0, [], masks=self._first_masks(mask),
                          tags={"continuation"} | set(base.tags) if base else set())
        self._check_token(where, track, 0, first, result, 0, 0)
        entry = PrefixEntry(label, prefix, mprefix, full, sampling, first, not track.compared, self.prefills, mask=mask,
                            tags=base.tags | {"continuation"} if base else frozenset())
        self.prefixes.append(entry)
        self._annotate(at, f"first token {first}")
        return entry

    def _prefix_notes(self, entry: PrefixEntry) -> list[str]:
        """What happened to a prefix since it was made that the protocol says must not
        matter (docs/design.md, Prefixes): later prefills, earlier inserts."""
        notes = []
        if self.prefills > entry.prefills_at:
            notes.append(f"{self.prefills - entry.prefills_at} prefill call(s) ran after {entry.label} was made (a "
                         f"Prefix stays valid and unchanged for the life of its engine, whatever later calls do)")
        if entry.inserts:
            notes.append(f"{entry.label} had been inserted {entry.inserts} time(s) before (an inserted prefix may be "
                         f"inserted again, into any free slot, and behaves as at its first insert)")
        return notes

    def _used(self, entry: PrefixEntry, use: str) -> None:
        """Count, for the report, a prefix used (inserted, continued, exported) after later
        prefills or after an insert: the two rules of docs/design.md's Prefixes."""
        if self.prefills > entry.prefills_at:
            self.run.count(f"prefixes {use} after later prefills")
        if entry.inserts:
            self.run.count(f"prefixes {use} after an insert")

    def _origin(self, entry: PrefixEntry, slot: int, how: str) -> str:
        return f"request {entry.label} in slot {slot} ({how})"

    def insert(self, draw: Draw) -> None:
        """A kept prefix into a slot (maybe occupied or out of range: refused), now and
        then another model's prefix (refused)."""
        run, d = self.run, self.d
        foreign = draw.chance(0.08)
        index = draw.index()
        slot = draw.integer(0, d.slots - 1) if draw.chance(0.8) else draw.integer(-1, d.slots + 1)
        if not self.prefixes:
            return
        entry = self.prefixes[index % len(self.prefixes)]
        self._read_pending()
        if foreign:
            theirs, mirrors, _ = run.foreign()
            at = self._say(f"state = engine.insert(<a prefix of another model>, state, {slot})")
            self._both(at, lambda: run.engine.insert(theirs, self.state, slot),
                       lambda: run.mirror.insert(mirrors, self.mstate, slot))
            self._fail_if_accepted(at, "a prefix made with other weights")
            return
        self._insert(entry, slot)

    def _insert(self, entry: PrefixEntry, slot: int) -> None:
        run = self.run
        at = self._say(f"state = engine.insert({entry.label}, state, {slot})")
        out = self._both(at, lambda: run.engine.insert(entry.backend, self.state, slot),
                         lambda: run.mirror.insert(entry.mirror, self.mstate, slot))
        if out is None:
            return
        self.state = out[0]
        notes = self._prefix_notes(entry)
        self._used(entry, "inserted")
        tags = set(entry.tags) | ({"reinsert"} if entry.inserts else set())
        entry.inserts += 1
        self.slots[slot] = SlotTrack(self._origin(entry, slot, "insert"), entry.prompt, entry.sampling, 0,
                                     [entry.first], compared=not entry.diverged, notes=tuple(notes),
                                     masks=self._first_masks(entry.mask), tags=tags)

    def _fail_if_accepted(self, at: int, what: str) -> None:
        if "refused" not in self.run.log[at]:
            self._fail(f"`{self.run.log[at].strip()}`: {what} was accepted (the reference refuses it)")

    def bulk_insert(self, draw: Draw) -> None:
        """A kept prefix into free slots, or (one time in five) into a slot list the
        protocol refuses: occupied, repeated, out of range or empty."""
        d = self.d
        index, order, count = draw.index(), draw.order(d.slots), draw.integer(1, d.slots)
        anything = [draw.integer(-1, d.slots) for _ in range(draw.integer(0, d.slots + 1))]
        good = not draw.chance(0.2)
        if not self.prefixes:
            return
        entry = self.prefixes[index % len(self.prefixes)]
        free = [s for s in order if s not in self.slots]
        self._read_pending()
        self._bulk_insert(entry, free[:count] if free and good else anything)

    def _bulk_insert(self, entry: PrefixEntry, slots: list[int]) -> None:
        run = self.run
        at = self._say(f"state, r = engine.bulk_insert({entry.label}, state, {slots})")
        out = self._both(at, lambda: run.engine.bulk_insert(entry.backend, self.state, list(slots)),
                         lambda: run.mirror.bulk_insert(entry.mirror, self.mstate, list(slots)))
        if out is None:
            return
        (self.state, result), _ = out
        where = f"`state, r = engine.bulk_insert({entry.label}, state, {slots})`"
        tokens, valid, lengths = np.asarray(result.tokens), np.asarray(result.valid, bool), np.asarray(result.lengths)
        n = len(slots)
        if tokens.shape[0] != n or not valid[:, 0].all() or valid.sum() != n or lengths.tolist() != [1] * n:
            self._fail(f"{where}: the result must hold one row per slot given ({n}), each one valid token with lengths 1; "
                       f"got tokens {tokens.tolist()}, valid {valid.tolist()}, lengths {lengths.tolist()}")
        firsts = []
        if entry.mask is not None:
            self.run.count("bulk_insert samples under the prefix's mask", n)
        notes = self._prefix_notes(entry)
        self._used(entry, "inserted")
        tags = set(entry.tags) | {"bulk_insert"} | ({"reinsert"} if entry.inserts else set())
        entry.inserts += 1
        for i, slot in enumerate(slots):
            track = SlotTrack(self._origin(entry, slot, f"bulk_insert sample {i}, row {i} of the result"), entry.prompt,
                              entry.sampling, i, [], compared=not (i == 0 and entry.diverged), notes=tuple(notes),
                              masks=self._first_masks(entry.mask), tags=set(tags))
            tok = int(tokens[i, 0])
            self._check_token(where, track, 0, tok, result, i, 0)
            track.tokens.append(tok)
            self.slots[slot] = track
            firsts.append(tok)
        self._annotate(at, f"first tokens {firsts}")

    def generate(self, draw: Draw) -> None:
        """Steps as the driver runs them: each result read at once, or (pipelined) after
        the next step is dispatched; where ``token_masks`` is declared, two calls in five
        give some slots masks at some steps (read in lock step before a masked step, as
        a grammar needs), a few of them first a call with a mask the protocol refuses."""
        steps, pipelined = draw.integer(1, STEPS_PER_GENERATE), draw.chance(0.5)
        masks = draw.step_masks(self.d, steps)
        refusal = draw.mask_refusal(self.d, GENERATE_MASK_REFUSALS, 0.25) if masks else None
        mixed = self._mixed_draw(draw)  # drawn last: an engine without mixed_step draws what it always drew
        if self.slots or self.pending or self.emptied:  # a fresh state is not worth a step
            if refusal is not None:
                self._refused_generate_masks(refusal, masks[0])
            if mixed is not None and self.slots:
                self._mixed(*mixed, masks[0] if masks else {})
                steps, masks = steps - 1, masks[1:] if masks else None
            self._steps(steps, pipelined, masks)

    def _mixed_draw(self, draw: Draw) -> tuple[list[int], SamplingParams, PrefixEntry | None, MaskDraw | None] | None:
        """Half the time on an engine declaring ``mixed_step``: the first step of a generate
        call is ``generate_with_prefill`` with one entry within the declared tokens (a new
        prompt, or with ``prefix_reuse`` a kept prefix continued; its first token under a
        mask at times, where ``token_masks`` is declared), beside the step's own masks
        where the generate call drew them."""
        d = self.d
        if not d.mixed_step or not draw.chance(0.5):
            return None
        sampling, index, continued = draw.sampling(d), draw.index(), draw.chance(0.5)
        base = self.prefixes[index % len(self.prefixes)] if d.prefix_reuse and continued and self.prefixes else None
        if base is not None and len(base.prompt) >= d.max_prefill:
            base = None
        room = min(d.mixed_step, d.max_prefill - (len(base.prompt) if base else 0))
        prompt = draw.tokens(d, 1, max(1, room))
        return prompt, sampling, base, draw.mask(d) if d.token_masks and draw.chance(0.3) else None

    def _mixed(self, prompt: list[int], sampling: SamplingParams, base: PrefixEntry | None, mask: MaskDraw | None,
               plan: dict[int, MaskDraw]) -> None:
        """generate_with_prefill: the step's tokens judged as a step's (under ``plan``'s
        masks, fitted to the slots' next positions), the entry's prefix as a prefill's (the
        mirror prefills it), kept for later calls as a prefill's is (inserted, continued,
        exported)."""
        stepped: list[tuple[Any, Any, int]] = []
        if plan:
            self._read_pending()  # a mask is for a slot's next position: the program knows it in lock step
        masks = self._live_masks(plan)
        masked = {"token_masks": masks} if masks else {}

        def call(**kw):
            request = PrefillRequest(tokens=kw["tokens"], sampling=kw["sampling"], existing_prefix=kw["existing_prefix"],
                                     token_mask=kw.get("token_mask"))
            at = len(self.run.log) - 1  # the call's line, just said
            state, result, prefixes = self.run.engine.generate_with_prefill(self.run.params, self.state,
                                                                            requests=[request], **masked)
            stepped.append((state, result, at))
            return prefixes.result(timeout=600)[0]

        shown = f", token_masks={self.show_masks(masks)}" if masks else ""
        entry = self._prefill(prompt, sampling, base, mask, mixed=(call, shown))
        if not stepped or entry is None:
            return
        self.state = stepped[0][0]
        self.run.count("mixed steps")
        if masks or mask is not None:
            self.run.count("mixed steps with masks")
        self._record_masks(masks)
        self.pending.append(Pending(stepped[0][1], stepped[0][2], frozenset(masks)))
        self._read_pending()

    def generate_with_overrides(self, draw: Draw) -> None:
        """A step forcing tokens into some slots, each at a position inside the slot's
        last result; sometimes beside an override the protocol refuses (then the whole
        call is refused and changes nothing)."""
        run = self.run
        picks = draw.overrides(self.d)
        after = draw.integer(0, STEPS_PER_GENERATE)
        plan = draw.slot_masks(self.d) if self.d.token_masks and draw.chance(0.4) else {}
        if not self.slots:
            return
        self._read_pending()  # overrides need the last results: the driver forces in lock step
        overrides, bad, mirror_overrides = self._overrides(*picks)
        if not overrides:
            return
        # masks in the same call are for the token after the forced one (or the next one);
        # beside a refused override, only slots without one get a mask (their position is sure)
        if bad:
            masks = self._live_masks({s: m for s, m in plan.items() if s not in overrides})
        else:
            masks = self._live_masks(plan, {s: self._completion_after(self.slots[s].tokens, ov)
                                            for s, ov in overrides.items()})
        masked = {"token_masks": masks} if masks else {}
        shown = f", token_masks={self.show_masks(masks)}" if masks else ""
        at = self._say(f"state, r{len(self.run.log)} = engine.generate(params, state, overrides={overrides!r}{shown})")
        if bad:  # refused for the override; the mirror, whose slots hold one token, is not given the masks
            self._both(at, lambda: run.engine.generate(run.params, self.state, overrides=overrides, **masked),
                       lambda: run.mirror.generate(run.mirror_params, self.mstate, overrides=mirror_overrides))
            self._fail_if_accepted(at, "an override outside the protocol's bounds")
            self._steps(after, False)  # the refused call changed nothing: the slots go on as before
            return
        try:
            self.state, result = run.engine.generate(run.params, self.state, overrides=overrides, **masked)
        except Exception as exc:
            if self._out_of_pages(at, exc):
                return
            self._annotate(at, f"raised {type(exc).__name__}")
            self._fail(f"`generate(overrides={overrides!r}{shown})` raised {type(exc).__name__} ({exc}); every "
                       f"override names an occupied slot, a token of the vocabulary and a position inside the slot's "
                       f"last result, and every mask allows a token, which the protocol accepts")
        self.run.count("overrides applied", len(overrides))
        for slot, ov in overrides.items():
            ov = ov if isinstance(ov, Override) else Override(ov)
            track = self.slots[slot]
            position = len(track.tokens) - 1 if ov.position is None else ov.position
            del track.tokens[position:]
            track.tokens.append(int(ov.token))
            track.masks = {j: w for j, w in track.masks.items() if j < position}
            track.tags.add("override")
            track.origin += f"; token {ov.token} forced at completion position {position}"
        self._record_masks(masks)
        if masks:
            self.run.count("masks beside overrides", len(masks))
        self.pending.append(Pending(result, at, frozenset(masks)))
        self._read_pending()
        self._steps(after, False)

    def _steps(self, steps: int, pipelined: bool, masks: list[dict[int, MaskDraw]] | None = None) -> None:
        run = self.run
        for k in range(steps):
            step_masks: dict[int, Any] = {}
            if masks and masks[k]:
                self._read_pending()  # a mask is for a slot's next position: the program knows it in lock step
                step_masks = self._live_masks(masks[k])
            masked = {"token_masks": step_masks} if step_masks else {}
            shown = f"token_masks={self.show_masks(step_masks)}" if step_masks else ""
            at = self._say(f"state, r{len(self.run.log)} = engine.generate(params, state{', ' if shown else ''}{shown})")
            try:
                self.state, result = run.engine.generate(run.params, self.state, **masked)
            except Exception as exc:
                if self._out_of_pages(at, exc):
                    return
                self._annotate(at, f"raised {type(exc).__name__}")
                self._fail(f"`generate({shown})` raised {type(exc).__name__}: {exc}")
            self._record_masks(step_masks)
            self.pending.append(Pending(result, at, frozenset(step_masks)))
            self._read_pending(keep_last=pipelined)

    def _overrides(self, picked, refusal: str | None, index: int) -> tuple[dict[int, Any], bool, dict[int, Any]]:
        """Overrides (drawn by :meth:`Draw.overrides`) for the picked slots that are
        occupied and have room, each inside the slot's last result (a bare token for the
        latest), plus the ``refusal`` kind of :data:`OVERRIDE_REFUSALS` if any; whether
        the call must be refused; and what the mirror is sent (its slots hold one token
        each: it never generates). Slots at the cache limit get none: whether a step that
        gave them no token is their last result is not specified."""
        d = self.d
        live = [s for s, t in sorted(self.slots.items()) if len(t.prompt) + len(t.tokens) < d.max_cache]
        overrides: dict[Any, Any] = {}
        mirror: dict[Any, Any] = {}
        for s, back, token, bare in picked:
            if s not in live:
                continue
            t = self.slots[s]
            back %= t.last
            position = len(t.tokens) - 1 - back
            overrides[s] = token if back == 0 and bare else Override(token, position)
            mirror[s] = token
        bad, kind = refusal is not None, refusal
        if bad:
            empty = [s for s in range(d.slots) if s not in self.slots]
            target = live[index % len(live)] if live else None
            if kind == "slot = max_slots" or (target is None and kind != "empty slot") or (kind == "empty slot" and not empty):
                overrides[d.slots] = mirror[d.slots] = 3
            elif kind == "empty slot":
                s = empty[index % len(empty)]
                overrides[s] = mirror[s] = 3
            elif kind.startswith("token"):
                token = {"token = vocab_size": d.vocab, "token -1": -1, "token 3.0": 3.0}[kind]
                overrides[target] = mirror[target] = token
            else:
                t = self.slots[target]
                position = len(t.tokens) if kind == "position after the last" else len(t.tokens) - t.last - 1
                overrides[target] = Override(3, position)
                mirror[target] = Override(3, 1)  # past the mirror slot's only token
        return overrides, bad, mirror

    def free(self, draw: Draw) -> None:
        """free_resource of an occupied slot, mostly; of an empty or out-of-range one else."""
        run, d = self.run, self.d
        index, any_slot, occupied_one = draw.index(), draw.integer(-1, d.slots), draw.chance(0.7)
        if not (self.slots or self.emptied):
            return
        occupied = sorted(self.slots)
        slot = occupied[index % len(occupied)] if occupied and occupied_one else any_slot
        self._free(slot)

    def _free(self, slot: int) -> None:
        run = self.run
        self._read_pending()
        at = self._say(f"state = engine.free_resource(state, {slot})")
        out = self._both(at, lambda: run.engine.free_resource(self.state, slot),
                         lambda: run.mirror.free_resource(self.mstate, slot))
        if out is not None:
            self.state = out[0]
            self.emptied |= self.slots.pop(slot, None) is not None

    def export(self, draw: Draw) -> None:
        """export_prefix of a kept prefix, checked against the reference's K/V."""
        run = self.run
        index = draw.index()
        if not self.prefixes:
            return
        entry = self.prefixes[index % len(self.prefixes)]
        self._read_pending()
        label = f"X{len(self.portables)}"
        at = self._say(f"{label} = engine.export_prefix({entry.label})")
        out = self._both(at, lambda: run.engine.export_prefix(entry.backend), lambda: run.mirror.export_prefix(entry.mirror))
        if out is None:
            return
        where = f"`{label} = engine.export_prefix({entry.label})`"
        notes = self._prefix_notes(entry)
        self._used(entry, "exported")
        try:
            data_bytes = out[0].to_bytes()
            portable = PortablePrefix.from_bytes(data_bytes)
        except Exception as exc:
            self._fail(f"{where}: the portable prefix does not survive to_bytes/from_bytes: {type(exc).__name__}: {exc}", notes)
        want_k, want_v = run.oracle.kv(list(entry.prompt))
        if portable.k.shape != want_k.shape:
            self._fail(f"{where}: exported K/V have shape {portable.k.shape}, the format's is (layers, kv_heads, "
                       f"true_length, head_dim) = {want_k.shape} (no padding, one entry per KV head)", notes)
        err = max(rel_l2(portable.k.ravel(), want_k.ravel()), rel_l2(portable.v.ravel(), want_v.ravel()))
        self._within("kv_rel_l2", err, f"{where}: exported K/V vs the reference's (K after rotate-half RoPE, per KV "
                                       f"head in the model's order)", notes)
        self._within("logits_rel_l2", rel_l2(portable.last_logits, run.oracle.logits(list(entry.prompt))),
                     f"{where}: exported last logits vs the reference's", notes)
        if tuple(portable.prompt_tokens.tolist()) != entry.prompt or portable.sampling.seed != entry.sampling.seed:
            self._fail(f"{where}: the portable prefix must carry the prompt ids and the request's seed "
                       f"({entry.sampling.seed}); it holds {portable.prompt_tokens.tolist()} and seed {portable.sampling.seed}")
        self.portables.append(PortableEntry(label, data_bytes, entry.prompt))

    def import_prefix(self, draw: Draw) -> None:
        """import_prefix of the reference's export of a kept prefix, of this backend's own
        export, or (refused) of another model's."""
        run = self.run
        source, index = draw.choice(["reference", "own", "foreign"]), draw.index()
        if not (self.prefixes or self.portables):
            return
        if source == "own" and not self.portables or source == "reference" and not self.prefixes:
            source = "own" if self.portables else "reference"
        self._read_pending()
        if source == "own":
            entry = self.portables[index % len(self.portables)]
            payload, name = entry.data, entry.label
        elif source == "reference":
            entry = self.prefixes[index % len(self.prefixes)]
            # the reference's own export (the class's method: the mirror may not declare it)
            exported = type(run.mirror).export_prefix(run.mirror, entry.mirror)
            payload, name = exported.to_bytes(), f"reference.export_prefix({entry.label})"
        else:
            payload, name = run.foreign()[2].to_bytes(), "<another model's portable prefix>"
        label = f"P{len(self.prefixes)}"
        at = self._say(f"{label} = engine.import_prefix({name})")
        out = self._both(at, lambda: run.engine.import_prefix(PortablePrefix.from_bytes(payload)),
                         lambda: run.mirror.import_prefix(PortablePrefix.from_bytes(payload)))
        if source == "foreign":
            self._fail_if_accepted(at, "a portable prefix of another model")
        if out is None:
            return
        prefix, mprefix = out
        portable = PortablePrefix.from_bytes(payload)
        prompt = tuple(int(t) for t in portable.prompt_tokens)
        where = f"`{label} = engine.import_prefix({name})`"
        if tuple(int(t) for t in np.asarray(prefix.prompt_tokens)) != prompt or prefix.sampling.seed != portable.sampling.seed:
            self._fail(f"{where}: the imported prefix must keep the portable prefix's prompt and seed")
        self._within("logits_rel_l2", rel_l2(np.asarray(prefix.host_logits(), np.float64), run.oracle.logits(list(prompt))),
                     f"{where}: Prefix.host_logits() vs the reference's")
        # An import has no result row: its first token is judged, its log-probs are not reported.
        track = SlotTrack(label, prompt, portable.sampling.model_copy(update={"logprobs": False, "top_logprobs": 0}), 0, [])
        first = int(prefix.first_token)
        self._check_token(where, track, 0, first, None, 0, 0)
        self.prefixes.append(PrefixEntry(label, prefix, mprefix, prompt, portable.sampling, first, not track.compared,
                                         self.prefills, tags=frozenset({"import"})))
        self._annotate(at, f"first token {first}")

    def teardown(self) -> None:
        # Read what is left, so a fault in the last step is seen too (not after a failure:
        # the first one is the one to report).
        if self.pending and not self.failed:
            self._read_pending()
        if not self.failed:
            self.run.keep_states(self.state, self.mstate)
        if self.run.pressure:  # this program's prefixes give their pages back before the next starts
            self.prefixes, self.portables, self.pending = [], [], []
