"""SentencePiece merges found with arrays (``polyengine.models.sp_merges``) equal the rule
stated as a loop, in the same order: on random vocabularies (ties in score, pieces that
are prefixes and suffixes of others, characters outside the BMP, NUL, duplicates, the
empty piece), with hashes that collide on purpose (the check that each hit is the piece
it names, and the loop taken when two pieces share a hash), and on the real Gemma 3
vocabulary (``tests/test_gemma3_real.py``)."""

from __future__ import annotations

import random

import pytest

from polyengine.models import sp_merges
from polyengine.models.sp_merges import merges_by_splitting, merges_from_scores

ALPHABET = ["a", "b", "c", "▁", "é", "\x00", "\U0001f600", "z"]


def vocabulary(seed: int, size: int = 400) -> tuple[list[str], list[float]]:
    rng = random.Random(seed)
    tokens = [c for c in ALPHABET]
    while len(tokens) < size:
        if rng.random() < 0.5:  # joins of known pieces: many splits hit
            tokens.append(rng.choice(tokens) + rng.choice(tokens))
        else:
            tokens.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 7))))
    tokens += rng.sample(tokens, 10) + [""]  # duplicates keep the first place and the last score
    scores = [float(rng.randint(-6, 0)) for _ in tokens]  # few values: many ties
    return tokens, scores


@pytest.fixture(autouse=True)
def arrays_at_any_size(monkeypatch):
    """These vocabularies are small: take the array path whatever their splits per step."""
    monkeypatch.setattr(sp_merges, "MIN_SPLITS_PER_STEP", 0)


@pytest.mark.parametrize("seed", range(6))
def test_the_arrays_find_the_loops_merges_in_its_order(seed, monkeypatch):
    tokens, scores = vocabulary(seed)
    expected = merges_by_splitting(tokens, scores)
    assert len(expected) > 100
    monkeypatch.setattr(sp_merges, "merges_by_splitting", pytest.fail)  # the array path, not the fallback
    assert merges_from_scores(tokens, scores) == expected


def test_a_hash_hit_on_another_string_is_no_merge(monkeypatch):
    """With base 1 a hash is the sum of the code points: "ba" hashes as the piece "ab"
    while no two pieces share a hash, so only the code point check keeps "ba"+"b" out."""
    tokens, scores = ["a", "b", "ab", "bab"], [0.0, 0.0, -1.0, -2.0]
    expected = merges_by_splitting(tokens, scores)
    assert expected == [("a", "b"), ("b", "ab")]
    monkeypatch.setattr(sp_merges, "HASH_BASE", 1)
    monkeypatch.setattr(sp_merges, "merges_by_splitting", pytest.fail)
    assert merges_from_scores(tokens, scores) == expected


def test_pieces_sharing_a_hash_take_the_loop(monkeypatch):
    tokens, scores = vocabulary(7)
    expected = merges_by_splitting(tokens, scores)
    calls = []

    def loop(*args):
        calls.append(1)
        return expected

    monkeypatch.setattr(sp_merges, "HASH_BASE", 1)  # anagrams share a hash ("ab", "ba")
    monkeypatch.setattr(sp_merges, "merges_by_splitting", loop)
    assert merges_from_scores(tokens, scores) == expected and calls == [1]


def test_vocabularies_without_merges():
    assert merges_from_scores([], []) == []
    assert merges_from_scores(["a", "b", "c"], [0.0, 0.0, 0.0]) == []
    assert merges_from_scores(["a", "b", "ab", "ab"], [0.0, 0.0, -1.0, -3.0]) == [("a", "b")]


def test_one_long_piece_per_length_takes_the_loop(monkeypatch):
    """A piece of each length up to 1,024 characters (MAX_TOKEN_CHARS): 1,023 steps of
    arrays for 523,776 splits; the loop runs, so such a vocabulary costs what the loop costs."""
    monkeypatch.setattr(sp_merges, "MIN_SPLITS_PER_STEP", 64)
    tokens = ["a", "b"] + ["ab" * (n // 2) + "a" * (n % 2) for n in range(2, 1025)]
    scores = [0.0] * len(tokens)
    calls = []
    loop = sp_merges.merges_by_splitting
    monkeypatch.setattr(sp_merges, "merges_by_splitting", lambda *a: calls.append(1) or loop(*a))
    merges = merges_from_scores(tokens, scores)
    assert calls == [1] and ("a", "b") in merges
