"""The page rules (docs/design.md, "Pages") checked on an engine that declares
``Capabilities.page_size``: one short program over its page pool and page lists
(``engine.pages``, ``prefix_pages``, ``slot_pages``).

A prefix of one and a half pages is inserted (its pages must be shared, not copied),
its slot steps (the partly filled last page is copied before the write, the prefix's
K/V unchanged), the slot is freed (the prefix's pages stay held, as before the insert),
then another request runs (none of its pages may be one the prefix still holds). Each
broken rule is one message: a backend that copies pages on insert, frees a shared page
or hands out a page still referenced is caught (tests/test_paged.py shows each).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from polyengine.pages import PageError
from polyengine.sampling import SamplingParams

__all__ = ["page_rule_problems"]


def page_rule_problems(engine: Any, params: Any, prompt: Sequence[int], other: Sequence[int]) -> list[str]:
    """What ``engine`` gets wrong of the page rules (empty: nothing). ``prompt`` holds
    one and a half pages (``page_size + page_size // 2`` tokens, at most
    ``max_prefill_length``, more than a page), ``other`` a few tokens. A release the
    pool refuses (a double free) ends the program as one more problem."""
    problems: list[str] = []
    try:
        _program(engine, params, prompt, other, problems)
    except PageError as exc:
        problems.append(f"the engine's page pool refused a release or share: {exc}")
    return problems


def _program(engine: Any, params: Any, prompt: Sequence[int], other: Sequence[int], problems: list[str]) -> None:
    pool, ps = engine.pages, engine.capabilities.page_size
    greedy = SamplingParams(temperature=0, max_tokens=8)
    n = len(prompt)
    prefix, _ = engine.prefill(params=params, tokens=list(prompt[:n]), sampling=greedy)
    pages = list(engine.prefix_pages(prefix).pages)
    if len(pages) != -(-n // ps) or engine.prefix_pages(prefix).length != n:
        problems.append(f"a prefix of {n} positions is held in {len(pages)} pages of {ps} (expected {-(-n // ps)})")
        return
    counts = [pool.refcount(p) for p in pages]
    kv = _kv(engine, prefix)
    held = pool.held
    state = engine.init_decode_state()
    state = engine.insert(prefix, state, 0)
    slot = list(engine.slot_pages(state, 0).pages)
    if slot != pages or pool.held != held:
        problems.append(f"insert copied pages: the slot holds pages {slot} and the pool {pool.held} pages, where "
                        f"sharing the prefix's {pages} leaves {held} (rule 3: share, never copy)")
    state, _ = engine.generate(params, state)
    slot = list(engine.slot_pages(state, 0).pages)
    if slot[-1] == pages[-1]:
        problems.append("the slot wrote into the partly filled page it shares with the prefix (rule 4: copy on write)")
    elif slot[-1] in pages:
        problems.append(f"page {slot[-1]} was handed out again (to copy the last page on write) while the prefix "
                        f"still holds it (rule 7: a page is reused only at count 0)")
    if not _same(kv, _kv(engine, prefix)):
        problems.append("a slot's step changed the K/V of the prefix inserted into it (rule 4)")
    state = engine.free_resource(state, 0)
    after = [pool.refcount(p) for p in pages]
    if after != counts:
        problems.append(f"free_resource released pages the prefix still holds: their counts went {counts} -> {after} "
                        f"(rule 6: free releases the slot's references only)")
        return  # the rest would only repeat it
    q, _ = engine.prefill(params=params, tokens=list(other), sampling=greedy)
    state = engine.insert(q, state, 1)
    for _ in range(ps + 1):  # past a page edge: the slot takes a new page
        state, _ = engine.generate(params, state)
    taken = (set(engine.prefix_pages(q).pages) | set(engine.slot_pages(state, 1).pages)) & set(pages)
    if taken:
        problems.append(f"pages {sorted(taken)} were handed out again while the prefix still holds them "
                        f"(rule 7: a page is reused only at count 0)")
    elif not _same(kv, _kv(engine, prefix)):
        problems.append("other requests changed the K/V of a held prefix (rule 7)")
    engine.free_resource(state, 1)


def _kv(engine: Any, prefix: Any) -> np.ndarray | None:
    """The prefix's K/V on the host (None without portable prefixes: not compared)."""
    if not engine.capabilities.portable_prefix:
        return None
    out = engine.export_prefix(prefix)
    return np.concatenate([out.k.ravel(), out.v.ravel()])


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return a is None or b is None or np.array_equal(a, b)
