"""The driver's prefix cache: prefixes of earlier prompts, found by longest match.

An entry is a whole :class:`~polyengine.protocol.Prefix` the engine made (its K/V from
position 0, wherever the engine keeps them), filed under its prompt tokens in a radix
tree (a trie whose edges are runs of token ids). A new prompt walks the tree once and
gets two answers: the longest entry that is a proper prefix of it (the driver continues
that entry with the rest of the prompt, always at least one token, so the first token
is drawn with the new request's own sampling), and how far the prompt matches any
cached prompt at all (the driver may prefill up to that point as a separate piece and
file it, so the next prompt sharing it finds an entry there).

Entries are whole prefixes: on a contiguous engine an entry of 512 tokens and one of
544 that extends it each hold their own K/V; on a paged one they share pages, and the
cache counts each page once (``pages_of``), however many entries hold it. A prefix is valid for as long as it is held (docs/design.md), so an
entry is safe to continue whatever happened since it was made. Where a prompt parts from
an entry, :meth:`PrefixCache.covering` finds an entry that holds the shared part, which
the driver cuts (``Engine.truncate_prefix``) instead of prefilling it again.

Memory: an entry costs ``Prefix.nbytes`` (the engine's count, padding included; an
estimate from the model when the engine gives none); on a paged engine the cache holds
``page_bytes`` for each distinct page its entries hold, so an entry costs the pages no
other entry holds. The cache never holds more than
its budget (``EngineConfig.prefix_cache_bytes``, which the engine's memory check
counted). Entries in use (referenced by a request whose prefill will continue them)
are never evicted. The others leave least recently used first (a hit makes an entry
the most recent), in two segments: entries filed for one prompt (its own prefix, in case
its conversation comes back) go before entries cut where two prompts part, which are
known to be shared. A one-prompt entry that a newer entry extends (a conversation's
previous turn, once the next turn is filed) becomes the least recent: the conversation
will continue the newer one. Under pressure, a stream of one-off prompts then pushes out
other one-off prompts, not the system prompt every request continues, and conversations
lose their superseded turns before their latest ones.

Tenants: every lookup and insert names a *partition* (any hashable; None is the
partition of requests that name none), and each partition has a tree of its own. A
prompt is matched only against prompts filed in its own partition, so neither whether a
prefix was found nor where a prompt is cut for a shared entry (both visible to a client,
as ``cached_tokens`` and as the time to the first token) depends on another partition's
prompts. The budget and the eviction order are shared: one partition's traffic can push
another's entries out (costing it hits, revealing no tokens). The server maps API keys
and ``cache_salt`` to partitions (docs/security.md, "Prefix cache and tenants").

Single-threaded: the scheduler calls it under its lock. ``stats`` are plain counters
that a metrics scraper on another thread may read at any time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

__all__ = ["CacheEntry", "CacheStats", "PrefixCache"]


@dataclass
class CacheStats:
    """Cumulative counts since the cache was made, and its size now."""

    queries: int = 0  # prompts looked up
    query_tokens: int = 0  # their tokens
    hits: int = 0  # prompts that continued an entry
    hit_tokens: int = 0  # prompt tokens whose K/V came from an entry
    inserts: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0


class _Node:
    """A radix tree node: ``edge`` is the run of token ids from its parent to it, so its
    depth is the length of the prompt it stands for."""

    __slots__ = ("edge", "parent", "children", "entry", "depth")

    def __init__(self, edge: tuple[int, ...], parent: "_Node | None", depth: int):
        self.edge, self.parent, self.depth = edge, parent, depth
        self.children: dict[int, _Node] = {}
        self.entry: CacheEntry | None = None


@dataclass(eq=False)
class CacheEntry:
    """One cached prefix: ``length`` prompt tokens; ``refs`` requests about to continue it."""

    prefix: Any  # polyengine.protocol.Prefix
    length: int
    nbytes: int  # what it cost when filed (paged: the pages no other entry held then)
    refs: int = 0
    shared: bool = False  # filed where two prompts part (known to begin several)
    node: _Node | None = field(default=None, repr=False)
    partition: Any = None  # the tenant it was filed for (see the module docstring)
    pages: tuple[int, ...] = ()  # the page ids it holds, on a paged engine (``pages_of``)


def _common(tokens: Sequence[int], at: int, edge: tuple[int, ...]) -> int:
    """How many leading tokens of ``tokens[at:]`` equal ``edge``'s."""
    if tuple(tokens[at: at + len(edge)]) == edge:
        return len(edge)
    n = 0
    for a, b in zip(tokens[at:], edge):
        if a != b:
            break
        n += 1
    return n


class PrefixCache:
    """Cached prefixes under a byte budget. ``estimate(prefix)`` sizes a prefix whose
    engine left ``nbytes`` at 0. On a paged engine, ``pages_of(prefix)`` gives a prefix's
    page ids and ``page_bytes`` a page's size: the cache then counts each distinct page
    once (entries extending one another share pages)."""

    def __init__(self, budget: int, *, estimate: Callable[[Any], int] | None = None,
                 pages_of: Callable[[Any], Sequence[int]] | None = None, page_bytes: int = 0):
        if budget < 0:
            raise ValueError(f"a prefix cache budget must be >= 0 bytes, got {budget}")
        if pages_of is not None and page_bytes < 1:
            raise ValueError(f"a paged prefix cache needs page_bytes >= 1, got {page_bytes}")
        self.budget = int(budget)
        self._estimate = estimate
        self._pages_of, self._page_bytes = pages_of, int(page_bytes)
        self._page_holders: dict[int, int] = {}  # page id -> entries holding it (paged)
        self._roots: dict[Any, _Node] = {}  # one tree per partition; a partition without entries has none
        self._lru: OrderedDict[CacheEntry, None] = OrderedDict()  # oldest use first
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._lru)

    # -- lookup ------------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], partition: Any = None, *, count: bool = True) -> tuple[CacheEntry | None, int]:
        """``(entry, matched)`` for a prompt of ``partition``: the longest entry of that
        partition shorter than the prompt whose tokens begin it (None if none), and how
        many of the prompt's leading tokens some prompt cached in that partition shares
        (at least the entry's length). Counts one query (``count`` False: none, for a
        caller that only plans, such as the scheduler's page count at admission); a hit
        is counted when the caller :meth:`acquire`\\ s the entry."""
        if count:
            self.stats.queries += 1
            self.stats.query_tokens += len(tokens)
        node, at, best = self._roots.get(partition), 0, None
        if node is None:
            return None, 0
        while True:
            if node.entry is not None and node.depth < len(tokens):
                best = node.entry
            if at == len(tokens):
                break
            child = node.children.get(tokens[at])
            if child is None:
                break
            n = _common(tokens, at, child.edge)
            at += n
            if n < len(child.edge):
                break
            node = child
        return best, at

    def covering(self, tokens: Sequence[int], partition: Any = None) -> CacheEntry | None:
        """An entry of ``partition`` whose prompt begins with all of ``tokens`` (the
        shortest such), or None: the entry a prompt
        that parts from it after ``len(tokens)`` tokens may take those tokens from
        (``Engine.truncate_prefix``). Counts nothing."""
        node, at = self._roots.get(partition), 0
        if node is None:
            return None
        while at < len(tokens):
            child = node.children.get(tokens[at])
            if child is None:
                return None
            n = _common(tokens, at, child.edge)
            if n < min(len(child.edge), len(tokens) - at):
                return None
            node, at = child, at + n
        best, todo = None, [node]
        while todo:  # the subtree's entries all begin with tokens
            n = todo.pop()
            e = n.entry
            if e is not None and (best is None or e.length < best.length):
                best = e
            todo.extend(n.children.values())
        return best

    def acquire(self, entry: CacheEntry) -> Any:
        """Take a reference to an entry (it cannot be evicted until :meth:`release`) and
        count it as a hit; returns its prefix."""
        entry.refs += 1
        self._lru.move_to_end(entry)
        self.count_hit(entry.length)
        return entry.prefix

    def count_hit(self, tokens: int) -> None:
        """Count a prompt that took ``tokens`` tokens' K/V from the cache."""
        self.stats.hits += 1
        self.stats.hit_tokens += int(tokens)

    def release(self, entry: CacheEntry) -> None:
        entry.refs -= 1
        if entry.refs < 0:
            raise RuntimeError("prefix cache entry released more often than acquired")

    # -- insertion and eviction ----------------------------------------------------------------

    def insert(self, prefix: Any, *, shared: bool = False, partition: Any = None) -> CacheEntry | None:
        """File ``prefix`` under its prompt tokens in ``partition``; returns its entry, or None when it does
        not fit the budget even after evicting every entry not in use. ``shared``: it is
        known to begin several prompts (evicted after the entries that are not). An entry
        already filed under the same tokens stays (marked used) and the new prefix is dropped."""
        tokens = tuple(int(t) for t in prefix.prompt_tokens)
        node = self._path(tokens, partition, create=False)
        if node is not None and node.entry is not None:
            node.entry.shared = node.entry.shared or shared
            self._lru.move_to_end(node.entry)
            return node.entry
        pages = tuple(int(p) for p in self._pages_of(prefix)) if self._pages_of is not None else ()
        if self._pages_of is not None:
            nbytes = len(set(pages)) * self._page_bytes
        else:
            nbytes = int(getattr(prefix, "nbytes", 0) or (self._estimate(prefix) if self._estimate else 0))
        if nbytes > self.budget or not self._make_room(nbytes, pages):
            return None
        nbytes = self._cost(nbytes, pages)  # paged: the pages no other entry holds
        node = self._path(tokens, partition, create=True)
        entry = node.entry = CacheEntry(prefix, len(tokens), nbytes, shared=shared, node=node, partition=partition,
                                        pages=pages)
        for page in set(pages):
            self._page_holders[page] = self._page_holders.get(page, 0) + 1
        self._lru[entry] = None
        below = self._entry_below(node)
        if below is not None and not below.shared:
            # A one-prompt entry that this one extends (a conversation's previous turn):
            # the next turn will continue this one, so that one goes first.
            self._lru.move_to_end(below, last=False)
        self.stats.inserts += 1
        self.stats.bytes += nbytes
        self.stats.entries = len(self._lru)
        return entry

    def _cost(self, nbytes: int, pages: tuple[int, ...]) -> int:
        """What filing an entry adds: its bytes, or (paged) its pages no entry holds yet."""
        if self._pages_of is None:
            return nbytes
        return self._page_bytes * sum(1 for p in set(pages) if p not in self._page_holders)

    def _make_room(self, nbytes: int, pages: tuple[int, ...] = ()) -> bool:
        """Evict entries not in use until ``nbytes`` (paged: ``pages``) fit: those filed
        for one prompt, least recently used first, then those where prompts part, least
        recently used first."""
        if self.stats.bytes + self._cost(nbytes, pages) <= self.budget:
            return True
        if self._pages_of is not None:  # what stays after evicting every entry not in use
            kept = set(pages).union(*(e.pages for e in self._lru if e.refs > 0))
            floor = len(kept) * self._page_bytes
        else:
            floor = self.stats.bytes - sum(e.nbytes for e in self._lru if e.refs == 0) + nbytes
        if floor > self.budget:
            return False  # even evicting everything not in use would not make room
        for entry in self._eviction_order():
            if self.stats.bytes + self._cost(nbytes, pages) <= self.budget:
                break
            self._remove(entry)
            self.stats.evictions += 1
        return True

    def _eviction_order(self) -> list[CacheEntry]:
        """Entries not in use, in the order they leave: one-prompt entries least recently
        used first, then entries where prompts part."""
        idle = [e for e in self._lru if e.refs == 0]
        return [e for e in idle if not e.shared] + [e for e in idle if e.shared]

    def evict_next(self) -> bool:
        """Evict the next entry in eviction order (a caller that needs its memory back,
        such as the scheduler short of K/V pages); whether there was one."""
        order = self._eviction_order()
        if not order:
            return False
        self._remove(order[0])
        self.stats.evictions += 1
        return True

    def idle_pages(self) -> dict[int, int]:
        """Paged: for each page that entries not in use hold, how many of them hold it."""
        out: dict[int, int] = {}
        for e in self._lru:
            if e.refs == 0:
                for page in set(e.pages):
                    out[page] = out.get(page, 0) + 1
        return out

    def _evict_to(self, target: int) -> None:
        """Evict entries not in use until at most ``target`` bytes stay: those filed for one
        prompt, least recently used first, then those where prompts part."""
        for entry in self._eviction_order():
            if self.stats.bytes <= target:
                break
            self._remove(entry)
            self.stats.evictions += 1

    def resize(self, budget: int) -> None:
        """A new budget (negative counts as 0): entries not in use leave, in eviction order,
        until the rest fit. Entries in use stay even over it (their requests continue
        them); an insert is filed only where it fits, as always."""
        self.budget = max(0, int(budget))
        self._evict_to(self.budget)

    def clear(self) -> None:
        """Drop every entry not in use (counted as evictions)."""
        for entry in [e for e in self._lru if e.refs == 0]:
            self._remove(entry)
            self.stats.evictions += 1

    def entries(self) -> list[CacheEntry]:
        """Every entry, least recently used first."""
        return list(self._lru)

    # -- the tree ----------------------------------------------------------------------------

    def _path(self, tokens: tuple[int, ...], partition: Any, *, create: bool) -> _Node | None:
        """The node standing for ``tokens`` in ``partition``'s tree (splitting an edge or
        adding a leaf with ``create``), or None when it is not in the tree."""
        node = self._roots.get(partition)
        if node is None:
            if not create:
                return None
            node = self._roots[partition] = _Node((), None, 0)
        at = 0
        while at < len(tokens):
            child = node.children.get(tokens[at])
            if child is None:
                if not create:
                    return None
                leaf = node.children[tokens[at]] = _Node(tokens[at:], node, len(tokens))
                return leaf
            n = _common(tokens, at, child.edge)
            if n == len(child.edge):
                node, at = child, at + n
                continue
            if not create:
                return None
            mid = _Node(child.edge[:n], node, node.depth + n)  # split the edge where the prompts part
            node.children[tokens[at]] = mid
            child.edge, child.parent = child.edge[n:], mid
            mid.children[child.edge[0]] = child
            node, at = mid, at + n
        return node

    @staticmethod
    def _entry_below(node: _Node) -> CacheEntry | None:
        """The longest entry that is a proper prefix of ``node``'s prompt."""
        node = node.parent
        while node is not None and node.entry is None:
            node = node.parent
        return None if node is None else node.entry

    def _remove(self, entry: CacheEntry) -> None:
        del self._lru[entry]
        if self._pages_of is None:
            self.stats.bytes -= entry.nbytes
        else:  # a page leaves the count with the last entry holding it
            for page in set(entry.pages):
                self._page_holders[page] -= 1
                if not self._page_holders[page]:
                    del self._page_holders[page]
            self.stats.bytes = len(self._page_holders) * self._page_bytes
        self.stats.entries = len(self._lru)
        node = entry.node
        node.entry, entry.node = None, None
        # Prune leaves that no longer lead to an entry, then merge a node left with one child.
        while node.parent is not None and node.entry is None and not node.children:
            del node.parent.children[node.edge[0]]
            node = node.parent
        if node.parent is not None and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()
            node.edge, node.depth, node.entry = node.edge + child.edge, child.depth, child.entry
            node.children = child.children
            for grandchild in node.children.values():
                grandchild.parent = node
            if node.entry is not None:
                node.entry.node = node
        root = self._roots.get(entry.partition)
        if root is not None and not root.children:  # many one-off salts must not leave empty trees behind
            del self._roots[entry.partition]
