"""Random requests and the float32 criterion the device-sampler tests share.

:func:`random_params` visits every sampling parameter at its edges; :func:`float32_explains`
says whether float32 noise can turn the reference's token into a port's: their float64
scores lie within ``F32_EPS * (1 + scale)``, ``scale`` the largest finite processed
logit magnitude (float32 carries ~7 digits, so each score is good to a few 1e-7 of its
scale; the bound leaves an order of magnitude of margin), counting the port's token as
kept when loosening top-p/min-p by the bound keeps it (a filter boundary within noise).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from polyengine.sampling import RowState, SamplingParams, gumbel, process_logits

F32_EPS = 1e-5
EDGE_SEEDS = [0, 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**63, 2**64 - 2, 2**64 - 1]


def edge_seeds(rng: np.random.Generator, n: int) -> list[int]:
    return EDGE_SEEDS + [int(s) for s in rng.integers(0, 2**64, n, dtype=np.uint64)]


def random_params(rng: np.random.Generator, vocab: int) -> SamplingParams:
    """Each parameter off half of the time, else at an edge or a random value."""
    pick = lambda *xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    kw: dict = {"seed": int(pick(0, 2**32 - 1, 2**32, 2**64 - 1, int(rng.integers(0, 2**64, dtype=np.uint64))))}
    kw["temperature"] = float(pick(0.0, 0.0, 1.0, 0.7, 2.5, 1e-3))
    if rng.random() < 0.5:
        kw["top_k"] = int(pick(1, 2, 5, vocab - 1, vocab, vocab + 10))
    if rng.random() < 0.5:
        kw["top_p"] = float(pick(1e-9, 0.3, 0.9, 0.999, 1.0))
    if rng.random() < 0.4:
        kw["min_p"] = float(pick(1e-6, 0.1, 0.5, 1.0))
    if rng.random() < 0.4:
        kw["repetition_penalty"] = float(pick(0.5, 1.0, 1.3, 100.0))
    if rng.random() < 0.4:
        kw["presence_penalty"] = float(pick(-2.0, 2.0, rng.uniform(-2, 2)))
    if rng.random() < 0.4:
        kw["frequency_penalty"] = float(pick(-2.0, 2.0, rng.uniform(-2, 2)))
    if rng.random() < 0.3:
        ids = [0, vocab - 1, *rng.integers(0, vocab, 2).tolist()]
        kw["logit_bias"] = {int(i): float(pick(-100.0, 100.0, rng.uniform(-5, 5))) for i in ids}
    if rng.random() < 0.3:
        kw["min_tokens"] = int(pick(1, 3, 100))
    if rng.random() < 0.3:
        kw["ignore_eos"] = True
    if rng.random() < 0.3:
        kw["stop_token_ids"] = [0, vocab - 1, int(rng.integers(vocab))]
    if rng.random() < 0.3:
        kw.update(logprobs=True, top_logprobs=int(pick(1, 5, 20)))
    return SamplingParams(**kw)


def random_requests(rng: np.random.Generator, vocab: int, rows: int):
    """``rows`` random requests ``(params, prompt, sample_index)``, a random number of
    recorded completion tokens ``(steps, rows)``, the matching reference rows, and
    logits with exact ties at the top and between two lower ids."""
    reqs, ref_rows = [], []
    for _ in range(rows):
        params = random_params(rng, vocab)
        prompt = rng.integers(0, vocab, int(rng.integers(0, 12)))
        index = int(rng.choice([0, 1, 4095]))
        reqs.append((params, prompt, index))
        ref_rows.append(RowState(params, index, 0, prompt, np.zeros(0, np.int64)))
    recorded = rng.integers(0, vocab, (int(rng.integers(0, 6)), rows))
    for toks in recorded:
        for r, row in enumerate(ref_rows):
            row.completion_tokens = np.append(row.completion_tokens, toks[r])
            row.step += 1
    logits = rng.standard_normal((rows, vocab)) * float(rng.choice([0.5, 3.0, 20.0]))
    logits[:, 5] = logits[:, 9] = logits.max(axis=1)  # exact ties at the top
    logits[:, 2] = logits[:, 3]
    return reqs, recorded, ref_rows, logits


def _loosened(params: SamplingParams, eps: float) -> SamplingParams:
    return params.replace(top_p=min(1.0, params.top_p * (1 + eps) + eps), min_p=max(0.0, params.min_p * (1 - eps) - eps))


def float32_explains(logits_row: np.ndarray, row: RowState, eos, ours: int, theirs: int) -> bool:
    """Whether float32 noise can turn the reference's ``theirs`` into ``ours``."""
    x = process_logits(logits_row, dataclasses.replace(row, params=row.params.replace(temperature=0.0)), eos)
    if row.params.temperature == 0.0:
        scale = np.abs(x[np.isfinite(x)]).max()
        return x[theirs] - x[ours] <= F32_EPS * (1 + scale)
    loose = dataclasses.replace(row, params=_loosened(row.params, F32_EPS))
    logp = process_logits(logits_row, loose, eos)
    scale = np.abs(logp[np.isfinite(logp)]).max() + np.abs(x[np.isfinite(x)]).max() / row.params.temperature
    g = gumbel(row.params.seed, np.arange(x.shape[0]), row.step, row.sample_index)
    s = logp + g
    return bool(np.isfinite(s[ours]) and s[theirs] - s[ours] <= F32_EPS * (1 + scale))
