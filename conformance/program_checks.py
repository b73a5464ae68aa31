"""How a differential program judges the backend's outputs against the reference's.

:class:`Judge` holds the comparisons (its subclass ``programs.Program`` makes the
calls): each token of each request against the oracle's decision for that request's
context, with its log-probs and top log-probs; each generate result's rows (``valid``,
``lengths``) against the program's model of the slots; measured errors against the
tolerances in force. Requests are judged token by token, never step by step, so a
backend with several tokens per step or asynchronous results is compared the same way.

A token may leave the reference's stream only at a near tie (:func:`wins_when_shifted`
and the reference's margin against ``tie_gap``) or at a filter boundary within
``support_slack``: then that request is reported and no longer compared. Anything else
raises :class:`ProgramFailure`, whose message ends with notes on what happened before
that the protocol says must not matter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from polyengine.engine import ResultTokens
from polyengine.sampling import RowState, SamplingParams
from polyengine.sampling.masks import unpack_mask

from polyengine.conformance.oracle import decide
from polyengine.conformance.program_draws import show, show_mask
from polyengine.conformance.stats import boundary_tokens

__all__ = ["ProgramFailure", "SlotTrack", "Pending", "Judge", "wins_when_shifted", "loses_when_shifted", "COMPOSED", "REQUIRED", "declared_pairs"]

# The capabilities a request can combine, and what declares each (None: every backend).
# A token compared in a request that combined two of them (a continuation under a mask,
# a bulk-inserted sample given an override, a prefix inserted again after it was
# continued, ...) exercises that pair; the layer counts every pair per configuration.
COMPOSED = {
    "mask": "token_masks",  # drawn under an allowed-token mask (prefill's, the prefix's, or a step's)
    "continuation": "prefix_reuse",  # its prefix continues another (existing_prefix)
    "bulk_insert": "bulk_insert",  # one of bulk_insert's samples
    "override": None,  # a token of it was forced (generate overrides)
    "reinsert": None,  # its prefix had been inserted before (the prefix cache's hit)
    "import": "portable_prefix",  # its prefix was imported
}


# Imports are one call kind in 28, so their pairs are reported but not required of a
# default run (a run that misses a required pair fails as under-exercised).
REQUIRED = ("mask", "continuation", "bulk_insert", "override", "reinsert")


def declared_pairs(capabilities, among=tuple(COMPOSED)) -> list[str]:
    """Every pair of :data:`COMPOSED` capabilities (``among`` them) a backend declares,
    as ``"a + b"``."""
    have = [name for name, field_name in COMPOSED.items()
            if name in among and (field_name is None or getattr(capabilities, field_name, False))]
    return [f"{a} + {b}" for i, a in enumerate(have) for b in have[i + 1:]]


class ProgramFailure(AssertionError):
    """A program's output differed from the reference's; the message says where and how."""


@dataclass
class SlotTrack:
    """One occupied slot as the program sees it: whose request, and its completion so far."""

    origin: str  # how the request got here, for messages
    prompt: tuple[int, ...]
    sampling: SamplingParams
    sample_index: int
    tokens: list[int]
    last: int = 1  # tokens in the slot's last result
    compared: bool = True  # False once the backend left the reference's stream at a near tie
    notes: tuple[str, ...] = ()  # what happened to its prefix that must not matter, for messages
    masks: dict[int, np.ndarray] = field(default_factory=dict)  # completion position -> its allowed-token mask
    tags: set[str] = field(default_factory=set)  # the capabilities its request combines (COMPOSED)


@dataclass
class Pending:
    """A generate result not read yet (the driver reads step n after dispatching n+1)."""

    result: ResultTokens
    call: int  # the log line of the call
    masked: frozenset[int] = frozenset()  # slots given a token mask in this step (each yields one token)


def wins_when_shifted(logits: np.ndarray, row: RowState, eos, token: int, shift: float) -> bool:
    """Whether the reference's sampler picks ``token`` once the raw logits move by
    ``shift`` in its favour (it up, every other token down, by half each).

    The decision margin of :func:`~polyengine.conformance.oracle.decide` is measured
    after the temperature and the filters; at a low temperature, or where the filters
    keep one token of two near-tied ones (a tiny top_p, top_k=1), logits that differ by
    rounding decide differently though that margin is large. A backend's rounding moves
    its raw logits, so the near tie is judged there too, by the same ``tie_gap``."""
    x = np.asarray(logits, np.float64) - shift / 2
    x[token] += shift
    return decide(x, row, eos).token == token


def loses_when_shifted(logits: np.ndarray, row: RowState, eos, want: int, token: int, shift: float) -> bool:
    """Whether the reference's sampler picks ``token`` once the raw logits move by
    ``shift`` against its own pick ``want`` (it down, every other token up, by half each):
    where ``want`` is kept by top-p only because it outranks a near-tied token, a
    backend's rounding that swaps the two drops ``want`` from the kept set and picks
    another (measured: a bf16 variant, issue 39)."""
    x = np.asarray(logits, np.float64) + shift / 2
    x[want] -= shift
    return decide(x, row, eos).token == token


class Judge:
    """The comparisons of a program. Expects ``run`` (a ``ProgramRun``), ``d`` (its
    :class:`Dims`), ``slots`` ({slot: SlotTrack}), ``pending`` (unread results) and the
    counters ``refused``, ``failed`` (set by the subclass)."""

    # -- logging and failing -------------------------------------------------------------------

    def _say(self, line: str) -> int:
        self.run.count("calls")
        self.run.log.append(line)
        return len(self.run.log) - 1

    def _annotate(self, at: int, note: str) -> None:
        self.run.log[at] += ("  # " if "  # " not in self.run.log[at] else "; ") + note

    def _fail(self, message: str, notes: tuple[str, ...] | list[str] = ()) -> None:
        self.failed = True
        self.run.log[-1] += "   <-- fails here"
        notes = list(notes)
        if self.refused:
            notes.append(f"{self.refused} call(s) of this program were refused before this: a refused call must "
                         f"change nothing")
        failure = ProgramFailure(message + "".join(f"\nnote: {n}" for n in notes))
        if self.run.first_failure is None:  # reported if the failure does not reproduce
            self.run.first_failure = (str(failure), list(self.run.log))
        raise failure

    # -- comparing tokens with the oracle ------------------------------------------------------

    def _check_token(self, where: str, track: SlotTrack, j: int, token: int, result: ResultTokens, row: int, col: int) -> None:
        """Completion token ``j`` of a request (the track's tokens before it are the context)
        against the reference's decision there, then its reported log-probs."""
        run, d = self.run, self.d
        mask = track.masks.get(j)
        if mask is not None:
            run.count("tokens checked against their mask")
            if not unpack_mask(mask, d.vocab)[token]:
                self._fail(f"{where}: completion token #{j} of {track.origin} is {token}, which its allowed-token "
                           f"mask leaves out (a masked-out id is -inf from sampling step 1 on: no bias, penalty, "
                           f"temperature or filter brings it back; docs/design.md, Allowed-token masks)", track.notes)
        if not track.compared:
            return
        context = list(track.prompt) + track.tokens[:j]
        logits = run.oracle.logits(context)
        row_state = RowState(track.sampling, track.sample_index, j, np.array(track.prompt), np.array(track.tokens[:j], np.int64),
                             mask)
        want = decide(logits, row_state, d.eos)
        run.count("tokens compared")
        tags = sorted(track.tags | ({"mask"} if track.masks else set()), key=list(COMPOSED).index)
        for i, a in enumerate(tags):
            for b in tags[i + 1:]:
                run.pairs[f"{a} + {b}"] = run.pairs.get(f"{a} + {b}", 0) + 1
        if token != want.token:
            label = f"{where}: completion token #{j} of {track.origin}"
            gap = want.gap
            if (gap < run.tol["tie_gap"] or wins_when_shifted(logits, row_state, d.eos, token, run.tol["tie_gap"])
                    or loses_when_shifted(logits, row_state, d.eos, want.token, token, run.tol["tie_gap"])):
                run.context.note(f"{label}: {token} instead of the reference's {want.token} at a near tie "
                                 f"(margin {gap:.3g}, or within tie_gap of the logits); not compared further")
                track.compared = False
                return
            edge = boundary_tokens(logits, row_state, d.eos, run.tol["support_slack"])
            if edge[token] or edge[want.token]:
                run.context.note(f"{label}: {token} instead of the reference's {want.token} at a top-k/top-p/min-p "
                                 f"boundary (support_slack); not compared further")
                track.compared = False
                return
            run.context.measure("tie_gap", gap, run.dtype, run.model, where=label)
            under = "" if mask is None else f", under the token mask {show_mask(mask, d.vocab)}"
            self._fail(f"{label} is {token}; the reference draws {want.token} there (its margin {gap:.3g} is above "
                       f"tie_gap {run.tol['tie_gap']:g}; request {show(track.sampling)}, sample {track.sample_index}, "
                       f"prompt of {len(track.prompt)} tokens{under})", track.notes)
        if track.sampling.logprobs:
            self._check_logprobs(where, track, j, token, context, result, row, col)

    def _check_logprobs(self, where, track: SlotTrack, j: int, token: int, context, result: ResultTokens, row, col) -> None:
        run = self.run
        label = f"{where}: the log-probs of completion token #{j} of {track.origin}"
        if result.logprobs is None:
            self._fail(f"{label}: the request asked for log-probs (logprobs=True) and the result has none")
        want = run.oracle.raw_logprobs(context)
        tol = run.tol["logprob_abs"]
        err = abs(float(result.logprobs[row, col]) - want[token])
        run.context.measure("logprob_abs", err, run.dtype, run.model, where=label)
        if not err <= tol:
            self._fail(f"{label}: reported {float(result.logprobs[row, col]):.5f} for token {token}, the reference's raw "
                       f"log-prob is {want[token]:.5f} (|error| {err:.3g} > logprob_abs {tol:g})", track.notes)
        k = track.sampling.top_logprobs
        if not k:
            return
        if result.top_ids is None or result.top_logprobs is None or result.top_ids.shape[-1] < k:
            self._fail(f"{label}: the request asked for top_logprobs={k} and the result holds "
                       f"{0 if result.top_ids is None else result.top_ids.shape[-1]} per token")
        ids = np.asarray(result.top_ids[row, col, :k], np.int64)
        vals = np.asarray(result.top_logprobs[row, col, :k], np.float64)
        ranked = np.sort(want)[::-1][:k]
        if len(set(ids.tolist())) != k or ids.min() < 0 or ids.max() >= self.d.vocab:
            self._fail(f"{label}: top ids {ids.tolist()} are not {k} distinct token ids")
        err = float(np.max(np.abs(vals - want[ids])))
        run.context.measure("logprob_abs", err, run.dtype, run.model, where=label + " (top)")
        if not err <= tol:
            self._fail(f"{label}: top log-probs {np.round(vals, 5).tolist()} for ids {ids.tolist()}, the reference's raw "
                       f"log-probs of those ids are {np.round(want[ids], 5).tolist()} (logprob_abs {tol:g})")
        off = np.abs(want[ids] - ranked) > 2 * tol
        if off.any():
            self._fail(f"{label}: top ids {ids.tolist()} are not the reference's top {k} in descending order "
                       f"({np.argsort(-want, kind='stable')[:k].tolist()}, up to ties within logprob_abs): the "
                       f"top log-probs rank the raw model's log-probs")

    # -- reading results -----------------------------------------------------------------------

    def _read_pending(self, keep_last: bool = False) -> None:
        while len(self.pending) > (1 if keep_last else 0):
            after_next = len(self.pending) > 1  # a later step was dispatched before this one is read
            self._read(self.pending.pop(0), after_next)

    def _read(self, p: Pending, after_next: bool) -> None:
        d, r = self.d, p.result
        if after_next:
            self.run.count("results read after the next step")
            self._annotate(p.call, "read after the next generate")
        where = f"the result of [{p.call}]" + (" (read after the next generate was dispatched)" if after_next else "")
        try:
            tokens, valid, lengths = np.asarray(r.tokens), np.asarray(r.valid, bool), np.asarray(r.lengths)
        except Exception as exc:  # the backend's step failed (an asynchronous one says so when read)
            self._fail(f"{where}: reading it raised {type(exc).__name__}: {exc}")
        if tokens.shape[0] != d.slots or valid.shape != tokens.shape or lengths.shape != (d.slots,):
            self._fail(f"{where}: tokens {tokens.shape}, valid {valid.shape}, lengths {lengths.shape}; generate returns "
                       f"one row per slot ({d.slots}), at most tokens_per_step={d.tokens_per_step} columns")
        if tokens.shape[1] > d.tokens_per_step:
            self._fail(f"{where}: {tokens.shape[1]} token columns, more than tokens_per_step={d.tokens_per_step}")
        shown = []
        for s in range(d.slots):
            row = valid[s]
            m = int(row.sum())
            if m and not row[:m].all():
                self._fail(f"{where}: slot {s}'s valid tokens are not first in its row ({row.tolist()})")
            track = self.slots.get(s)
            if track is None:
                if m or int(lengths[s]) != 0:
                    self._fail(f"{where}: slot {s} is empty and reported {m} valid token(s), lengths {int(lengths[s])} "
                               f"(an empty slot reports valid == 0 and lengths == 0)")
                continue
            room = d.max_cache - len(track.prompt) - len(track.tokens)
            if room <= 0 and m:
                self._fail(f"{where}: slot {s} ({track.origin}) is full (prompt + completion == max_cache_length "
                           f"{d.max_cache}) and reported {m} more token(s)")
            if room > 0 and not 1 <= m <= min(d.tokens_per_step, room):
                self._fail(f"{where}: slot {s} ({track.origin}) has room for {room} more token(s) and reported {m} "
                           f"(a generate step gives every occupied slot with room 1..tokens_per_step tokens, never "
                           f"past max_cache_length)")
            if s in p.masked and room > 0 and m != 1:
                self._fail(f"{where}: slot {s} ({track.origin}) was given a token mask in this step and yielded {m} "
                           f"tokens; a masked slot yields exactly one token in that step, whatever tokens_per_step "
                           f"(the mask is for its next token only; docs/design.md, Allowed-token masks)")
            if int(lengths[s]) != len(track.tokens) + m:
                self._fail(f"{where}: lengths[{s}] is {int(lengths[s])}; slot {s} ({track.origin}) held "
                           f"{len(track.tokens)} completion token(s) and got {m} more")
            for c in range(m):
                tok = int(tokens[s, c])
                self._check_token(where, track, len(track.tokens), tok, r, s, c)
                track.tokens.append(tok)
            if m:
                track.last = m
                shown.append(f"{s}: {[int(t) for t in tokens[s, :m]]}")
        self._annotate(p.call, "slot " + ", ".join(shown) if shown else "no tokens")


    def _within(self, quantity: str, measured: float, what: str, notes: list[str] | tuple[str, ...] = ()) -> None:
        run = self.run
        run.context.measure(quantity, measured, run.dtype, run.model, where=what)
        if not measured <= run.tol[quantity]:
            self._fail(f"{what}: {quantity} = {measured:.3g} exceeds the tolerance {run.tol[quantity]:.3g}", notes)
