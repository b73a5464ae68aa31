"""Portable prefix tails (capability ``portable_prefix_tail``): the checks the suite runs
on ``import_prefix_tail``, as functions over an engine so a broken engine can be run on
them directly (tests/test_prefix_tails.py).

:func:`tail_import_problems`: a tail imported onto a prefix holding its head is the
whole prefix imported, exactly (both give the engine the same float32 values): the same
K/V (through ``export_prefix``), prompt, logits and first token, and the same tokens in
a few decode steps after insert; the head prefix is left as it was.
:func:`tail_refusal_problems`: a head whose prompt ids differ, a start beyond the head,
a head made by another engine of other weights are ``InvalidRequest``, and a paged
engine holds no more pages after the refusals than before.
:func:`tail_sharing_problems`: on an engine that declares ``page_size``, the imported
prefix holds the head's full pages below the start (no new page for them), a partly
filled page at the start is copied before the tail is written into it, and the head's
K/V stay as they were. Each returns what the engine gets wrong (empty: nothing).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from polyengine.errors import InvalidRequest
from polyengine.pages import pages_for
from polyengine.prefix import PortablePrefix

from polyengine.conformance.harness import SlotDriver

__all__ = ["tail_starts", "tail_import_problems", "tail_refusal_problems", "tail_sharing_problems", "head_of"]

_STEPS = 3  # decode steps compared after insert


def tail_starts(n: int, page_size: int) -> list[tuple[int, int]]:
    """``(start, head length)`` cases for a prompt of ``n`` tokens: start 0 (onto any
    prefix), a page edge, a position inside a page (onto a head of exactly that many
    tokens and onto one holding the whole prompt), and ``n`` (an empty tail). Without
    pages the edges are those pages of 8 would have."""
    ps = page_size if 0 < page_size < n else min(8, max(1, n // 2))
    edge = ps * max(1, (n - 1) // ps) if ps < n else n // 2
    mid = edge + ps // 2 if edge + ps // 2 < n else max(1, edge - ps // 2)
    if ps == 1:
        mid = max(1, edge - 1)
    return [(0, 1), (edge, edge), (mid, mid), (mid, n), (n, n)]


def head_of(whole: PortablePrefix, length: int) -> PortablePrefix:
    """A whole portable prefix of ``whole``'s first ``length`` positions (its logits are
    ``whole``'s: a head is only there to be continued or to carry a tail)."""
    return PortablePrefix(k=whole.k[:, :, :length], v=whole.v[:, :, :length], prompt_tokens=whole.prompt_tokens[:length],
                          last_logits=whole.last_logits, sampling=whole.sampling,
                          model_fingerprint=whole.model_fingerprint)


def tail_import_problems(engine: Any, params: Any, whole: PortablePrefix,
                         cases: Sequence[tuple[int, int]]) -> list[str]:
    """``import_prefix_tail(whole.tail(start), existing_prefix=head)`` against
    ``import_prefix(whole)`` for each ``(start, head length)``: the head is
    ``whole``'s first positions imported."""
    problems: list[str] = []
    want = engine.import_prefix(whole)
    want_kv = _kv(engine, want)
    for start, h in cases:
        head = engine.import_prefix(head_of(whole, h))
        head_kv = _kv(engine, head)
        tail = PortablePrefix.from_bytes(whole.tail(start).to_bytes())  # a tail travels as bytes too
        got = engine.import_prefix_tail(tail, existing_prefix=head)
        what = f"a tail from position {start} onto a head of {h} tokens"
        if list(np.asarray(got.prompt_tokens)) != whole.prompt_tokens.tolist():
            problems.append(f"{what}: the prefix holds prompt {list(got.prompt_tokens)}, expected the whole prompt")
            continue
        if not np.array_equal(_kv(engine, got), want_kv):
            exported = engine.export_prefix(got)
            bad = np.flatnonzero(np.any(exported.k != engine.export_prefix(want).k, axis=(0, 1, 3)))
            problems.append(f"{what}: its K/V differ from the whole prefix imported (positions {bad.tolist()[:8]}; "
                            f"below {start} they must be the head's, from {start} the tail's)")
        if not np.array_equal(got.host_logits(), want.host_logits()) or int(got.first_token) != int(want.first_token):
            problems.append(f"{what}: its logits or first token ({got.first_token}) differ from the whole prefix "
                            f"imported ({want.first_token})")
        if not np.array_equal(_kv(engine, head), head_kv):
            problems.append(f"{what}: the head prefix's K/V changed (it must stay as it was)")
        a, b = _decode(engine, params, want), _decode(engine, params, got)
        if a != b:
            problems.append(f"{what}: {_STEPS} decode steps after insert give {b}, the whole prefix imported {a}")
    return problems


def tail_refusal_problems(engine: Any, params: Any, whole: PortablePrefix, foreign: Any) -> list[str]:
    """The refusals (InvalidRequest) and, paged, no page held after them. ``foreign`` is a
    prefix of the same prompt made by an engine of other weights."""
    problems: list[str] = []
    n = whole.true_length
    start = max(1, n // 2)
    pool = getattr(engine, "pages", None) if engine.capabilities.page_size else None
    other_ids = whole.prompt_tokens.copy()
    other_ids[start - 1] = (int(other_ids[start - 1]) + 1) % engine.vocab_size
    differs = head_of(whole, n)
    differs.prompt_tokens = other_ids
    heads = {"differs": engine.import_prefix(differs), "short": engine.import_prefix(head_of(whole, start - 1))
             if start > 1 else None}
    cases = [(f"a head whose prompt id {start - 1} differs from the tail's prompt", heads["differs"]),
             (f"a head of {start - 1} tokens (the tail starts at {start})", heads["short"]),
             ("a head made by an engine of other weights", foreign)]
    refs = _references(pool) if pool is not None else None
    for what, head in cases:
        if head is None:
            continue
        try:
            out = engine.import_prefix_tail(whole.tail(start), existing_prefix=head)
        except InvalidRequest:
            continue
        except Exception as exc:  # noqa: BLE001 - reported as the wrong error
            problems.append(f"import_prefix_tail onto {what} raised {type(exc).__name__} ({exc}); expected "
                            f"InvalidRequest (EngineBase.check_portable_tail)")
            continue
        problems.append(f"import_prefix_tail accepted {what}: it must be refused with InvalidRequest, its K/V are "
                        f"not the tail's head")
        del out
    if pool is not None and _references(pool) != refs:
        problems.append(f"the refused imports left {_references(pool) - refs} page reference(s) held "
                        f"(a refusal takes nothing)")
    return problems


def _references(pool: Any) -> int:
    """Every page's holders, summed: a refusal that shares a page and keeps the share
    changes this though no page is newly held."""
    return sum(pool.refcount(p) for p in range(pool.allocated))


def tail_sharing_problems(engine: Any, params: Any, whole: PortablePrefix) -> list[str]:
    """Paged: the tail's import shares the head's full pages below its start (a start at
    a page edge and one inside a page; the head prefilled here)."""
    problems: list[str] = []
    pool, ps, n = engine.pages, engine.capabilities.page_size, whole.true_length
    edge = ps * ((n - 1) // ps)
    if edge < ps:
        return [f"a prompt of {n} tokens holds no full page of {ps} before its last position; the check needs more"]
    greedy = whole.sampling
    h = min(n, edge + max(1, ps // 2))
    head, _ = engine.prefill(params=params, tokens=whole.prompt_tokens[:h].tolist(), sampling=greedy)
    head_pages = list(engine.prefix_pages(head).pages)
    head_kv = _kv(engine, head)
    for start in sorted({edge, h - 1} - {0}):
        full = start // ps
        counts = [pool.refcount(p) for p in head_pages]
        held = pool.held
        got = engine.import_prefix_tail(whole.tail(start), existing_prefix=head)
        pages = list(engine.prefix_pages(got).pages)
        new = pool.held - held
        if pages[:full] != head_pages[:full]:
            problems.append(f"a tail from position {start} (page size {ps}): the imported prefix holds pages "
                            f"{pages[:full]} for the head's {full} full page(s), not the head's {head_pages[:full]} "
                            f"(they must be shared, not copied)")
        expected = pages_for(n, ps) - full
        if new != expected:
            problems.append(f"a tail from position {start} took {new} new page(s) from the pool; sharing the head's "
                            f"{full} full page(s) takes {expected}")
        if start % ps and pages[full] == head_pages[full]:
            problems.append(f"a tail from position {start} was written into the partly filled page it shares with "
                            f"the head (copy on write)")
        if [pool.refcount(p) for p in head_pages[:full]] != [c + 1 for c in counts[:full]]:
            problems.append(f"a tail from position {start}: the head's full pages' counts did not go up by one")
        if not np.array_equal(_kv(engine, head), head_kv):
            problems.append(f"a tail from position {start}: the head prefix's K/V changed")
        del got
    return problems


def _kv(engine: Any, prefix: Any) -> np.ndarray:
    out = engine.export_prefix(prefix)
    return np.concatenate([out.k.ravel(), out.v.ravel()])


def _decode(engine: Any, params: Any, prefix: Any) -> list[int]:
    d = SlotDriver(engine, params)
    d.insert_prefix(0, prefix)
    while len(d.tokens[0]) < _STEPS + 1:
        before = len(d.tokens[0])
        d.step()
        if len(d.tokens[0]) == before:
            break
    d.free(0)
    return d.tokens[0][: _STEPS + 1]
