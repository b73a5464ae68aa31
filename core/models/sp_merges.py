"""The merges of a SentencePiece BPE vocabulary, derived from its pieces and scores.

SentencePiece keeps no merge list. The rule (transformers' conversion, which
``tokenizers``' BPE then reproduces): every split of a piece into two known pieces is a
merge, ranked by the merged piece's score (best first), ties by the left piece's length,
then the right's (longer first), then the piece's place in the vocabulary.

:func:`merges_by_splitting` states the rule directly: a Python loop over every split of
every piece, a dictionary lookup for each half. On Gemma 3's 262,144 pieces that is 1.2M
substrings and lookups (1.5-3 s of a model's load on this project's hosts, where
llama.cpp loads the whole file in a fifth of a second). :func:`merges_from_scores` finds
the same merges in array operations: pieces of one length at a time as arrays of code
points, a polynomial hash of every prefix (64-bit, wrapping), each half looked up by its
hash among the pieces' hashes, and every hit checked code point by code point against
the piece it names, so a hash collision can only cost a lookup, never add or lose a
merge. When two pieces share a hash (possible for crafted vocabularies, not seen in real
ones) the lookup could miss, so the loop runs instead; so it does for a vocabulary with
few pieces of each length, where the arrays' steps would outnumber the loop's lookups.
``tests/test_tokenizer_merges.py`` holds the two equal on real and random vocabularies
and on both paths.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["merges_from_scores", "merges_by_splitting"]

HASH_BASE = 0x100000001B3  # any odd 64-bit number; a test swaps in colliding ones
# The array path takes a few array operations per (piece length, split point), the loop a
# dictionary lookup or two per split: arrays where each such step covers at least this
# many splits on average (real vocabularies: thousands; Gemma 3's 2,600), else the loop, so
# a vocabulary of one long piece of each length (up to MAX_TOKEN_CHARS) costs no more
# than the loop would.
MIN_SPLITS_PER_STEP = 64


def merges_by_splitting(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The rule as a loop (the fallback, and the model the array path is tested against)."""
    score_of = dict(zip(tokens, scores))
    known = score_of.__contains__
    found = []
    for piece, score in score_of.items():
        found.extend((score, k, len(piece) - k, piece[:k], piece[k:]) for k in range(1, len(piece))
                     if known(piece[:k]) and known(piece[k:]))
    # sorted(reverse=True) keeps equal keys in their original order (the pieces' order)
    found.sort(key=lambda m: m[:3], reverse=True)
    return [(left, right) for _, _, _, left, right in found]


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The same merges as :func:`merges_by_splitting`, in the same order, found with arrays."""
    score_of = dict(zip(tokens, scores))
    pieces = list(score_of)
    lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
    steps = int(np.maximum(np.unique(lengths) - 1, 0).sum())
    if int(np.maximum(lengths - 1, 0).sum()) < MIN_SPLITS_PER_STEP * steps:
        return merges_by_splitting(tokens, scores)
    groups = _groups(pieces, lengths)
    hashes = np.zeros(len(pieces), dtype=np.uint64)
    for idx, _, prefix in groups.values():
        hashes[idx] = prefix[:, -1]
    table = np.argsort(hashes, kind="stable")
    sorted_hashes = hashes[table]
    if len(sorted_hashes) > 1 and bool((sorted_hashes[1:] == sorted_hashes[:-1]).any()):
        return merges_by_splitting(tokens, scores)  # two pieces share a hash: a lookup could miss one
    row = np.zeros(len(pieces), dtype=np.int64)  # each piece's row in its length's group
    for idx, _, _ in groups.values():
        row[idx] = np.arange(len(idx))

    def lookup(h: np.ndarray) -> np.ndarray:
        at = np.minimum(np.searchsorted(sorted_hashes, h), len(sorted_hashes) - 1)
        return np.where(sorted_hashes[at] == h, table[at], -1)

    def same(ids: np.ndarray, codes: np.ndarray) -> np.ndarray:
        """Whether each piece ``ids[j]`` is exactly the code points ``codes[j]``."""
        ok = lengths[ids] == codes.shape[1]
        if ok.any():
            _, theirs, _ = groups[codes.shape[1]]
            ok[ok] = (theirs[row[ids[ok]]] == codes[ok]).all(axis=1)
        return ok

    parts = [_splits(n, idx, codes, prefix, lookup, same) for n, (idx, codes, prefix) in groups.items() if n > 1]
    if not parts:
        return []
    piece, left, right, k = (np.concatenate(p) for p in zip(*parts))
    score = np.asarray(list(score_of.values()), dtype=np.float64)[piece]
    order = np.lexsort((piece, -(lengths[piece] - k), -k, -score))
    return list(zip(map(pieces.__getitem__, left[order].tolist()), map(pieces.__getitem__, right[order].tolist())))


def _groups(pieces: list[str], lengths: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """For each length n: the pieces' indices, their code points (m, n) and the hashes of
    their prefixes (m, n + 1; column k hashes the first k code points)."""
    groups = {}
    for n in np.unique(lengths).tolist():
        idx = np.flatnonzero(lengths == n)
        codes = np.zeros((len(idx), n), dtype=np.uint32)
        if n:
            codes[:] = np.array([pieces[i] for i in idx.tolist()], dtype=f"<U{n}").view(np.uint32).reshape(len(idx), n)
        prefix = np.zeros((len(idx), n + 1), dtype=np.uint64)
        for k in range(n):  # array arithmetic wraps modulo 2**64 silently
            prefix[:, k + 1] = prefix[:, k] * np.uint64(HASH_BASE) + codes[:, k].astype(np.uint64) + np.uint64(1)
        groups[n] = (idx, codes, prefix)
    return groups


def _splits(n: int, idx: np.ndarray, codes: np.ndarray, prefix: np.ndarray, lookup, same):
    """The splits of the pieces of length ``n`` into two known pieces: (piece, left,
    right, left length) arrays."""
    found = []
    power = np.ones(n + 1, dtype=np.uint64)  # power[j] = HASH_BASE ** j, wrapping as the hashes do
    for j in range(1, n + 1):
        power[j:j + 1] = power[j - 1:j] * np.uint64(HASH_BASE)
    for k in range(1, n):
        hit = np.flatnonzero((left := lookup(prefix[:, k])) >= 0)  # the right half only where the left is known
        right = lookup(prefix[hit, n] - prefix[hit, k] * power[n - k])
        hit, right = hit[right >= 0], right[right >= 0]
        keep = same(left[hit], codes[hit, :k]) & same(right, codes[hit, k:])
        hit, right = hit[keep], right[keep]
        found.append((idx[hit], left[hit], right, np.full(len(hit), k, dtype=np.int64)))
    return tuple(np.concatenate(column) for column in zip(*found))
