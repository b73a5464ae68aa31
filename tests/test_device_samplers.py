"""One contract for every device sampler: the torch port (``backends/torch_common``, in
float32 and float64) and the JAX port (``backends/tpu_jax``, with the full-vocabulary
sort and with the bounded top-k candidates), each against the core's reference
(NumPy float64, ``polyengine.sampling``).

The stream comes first (everything else draws from it): uniforms equal to the core's
bit for bit, Gumbel noise finite and close for every one of the 2**24 uniforms, ties
to the lowest id. Then the sampler: random requests (every parameter visited at its
edges) installed in a few rows with random completions, one step compared with the
reference. A float64 port must give the reference's tokens and top ids exactly; a
float32 port may differ only where float32 noise can decide
(:func:`sampler_cases.float32_explains`). Deterministic seeds: nothing here fails by
chance. Port-only tests stay in ``test_torch_sampling.py`` and ``test_tpu_jax_sampling.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from polyengine.errors import InvalidRequest
from polyengine.sampling import RowState, SamplingParams, raw_logprobs
from polyengine.sampling import sample as reference_sample
from polyengine.sampling import threefry as ref_threefry
from polyengine.sampling.rows import split_seed
from polyengine.sampling.sampler import _top_ids

from isa_paths import ISAS, kernels_for
from sampler_cases import edge_seeds, float32_explains, random_requests

_VOCAB, _ROWS = 128, 6  # one shape for every sampler case: one compilation per JAX program


class TorchPort:
    """The torch sampler (a stateful ``TorchSampler``) in one work dtype."""

    def __init__(self, dtype: str):
        import torch

        self.torch = torch
        self.dtype = getattr(torch, dtype)
        self.exact = dtype == "float64"

    def new(self, requests, vocab, eos):
        from polyengine.backends.torch_common.sampling import TorchSampler

        sampler = TorchSampler(vocab, len(requests), eos, dtype=self.dtype)
        for r, (params, prompt, index) in enumerate(requests):
            sampler.install(r, params, prompt, sample_index=index)
        return sampler

    def install(self, sampler, row, params, prompt):
        sampler.install(row, params, prompt)
        return sampler

    def record(self, sampler, tokens, mask):
        sampler.record(self.torch.from_numpy(np.asarray(tokens, np.int64)), self.torch.from_numpy(np.asarray(mask)))
        return sampler

    def override(self, sampler, tokens, mask):
        sampler.override(self.torch.from_numpy(np.asarray(tokens, np.int64)), self.torch.from_numpy(np.asarray(mask)))
        return sampler

    def sample(self, sampler, logits):
        out = sampler.sample(self.torch.from_numpy(logits).to(self.dtype), num_top=20)
        return {k: getattr(out, k).numpy() for k in ("tokens", "logprobs", "top_ids", "top_logprobs")}

    def stats(self, sampler):
        s = sampler.state
        return s.counts.numpy(), s.step.numpy(), s.last_token.numpy()

    def state(self, sampler):
        return {k: v.clone() for k, v in sampler.state.as_dict().items()}

    def same_state(self, a, b):
        return all(self.torch.equal(a[k], b[k]) for k in a)

    def uniforms64(self, seeds, steps, samples, vocab):
        from polyengine.backends.torch_common import threefry

        col = lambda xs: self.torch.tensor(xs, dtype=self.torch.int64)[:, None]  # noqa: E731
        lo, hi = zip(*(split_seed(s) for s in seeds))
        ctr = threefry.counter_hi(col(steps), col(samples))
        return threefry.uniforms(col(lo), col(hi), self.torch.arange(vocab)[None, :], ctr,
                                 dtype=self.torch.float64).numpy()

    def gumbel_from_bits(self, bits):
        from polyengine.backends.torch_common import threefry

        return threefry.gumbel_from_bits(self.torch.from_numpy(bits.view(np.int32)), self.torch.float32).double().numpy()

    def argmax_lowest(self, x):
        from polyengine.backends.torch_common.sampling import argmax_lowest

        return argmax_lowest(self.torch.from_numpy(x)).tolist()

    def top_n(self, x, n):
        from polyengine.backends.torch_common.sampling import top_n

        ids, vals = top_n(self.torch.from_numpy(x), n)
        return ids.numpy(), vals.numpy()


class CpuKernelPort(TorchPort):
    """The torch sampler with the cpu backend's compiled pass for the stream's bits
    and draw (``TorchSampler(kernels=...)``, option ``sampler_kernel``); skipped where the
    kernels cannot be compiled."""

    def __init__(self, dtype: str, isa: str = "auto"):
        super().__init__(dtype)
        self.kernels = kernels_for(isa, threads=1)

    def new(self, requests, vocab, eos):
        sampler = super().new(requests, vocab, eos)
        sampler.kernels = self.kernels
        return sampler

    def uniforms64(self, seeds, steps, samples, vocab):
        from polyengine.backends.torch_common import threefry

        words = lambda xs: self.torch.tensor([threefry.int32_bits(x) for x in xs], dtype=self.torch.int32)  # noqa: E731
        lo, hi = zip(*(split_seed(s) for s in seeds))
        ctr = threefry.counter_hi(self.torch.tensor(steps), self.torch.tensor(samples))
        m = self.kernels.threefry_bits(words(lo), words(hi), ctr, vocab)
        return (m.numpy().astype(np.float64) + 0.5) * 2.0**-24


class JaxPort:
    """The JAX sampler (a functional state, jitted steps) with ``candidates`` bounding
    the sort that top-k/top-p need (3: nearly every filtering batch sorts the whole
    vocabulary; 64: most take the bounded path)."""

    exact = False

    def __init__(self, candidates: int):
        import jax
        import jax.numpy as jnp

        from polyengine.backends.tpu_jax import sampling as smp

        self.jax, self.jnp, self.smp, self.candidates = jax, jnp, smp, candidates
        self._sample = _jax_jitted()["sample"]
        self._install, self._record, self._override = (_jax_jitted()[k] for k in ("install", "record", "override"))

    def new(self, requests, vocab, eos):
        jnp, smp = self.jnp, self.smp
        n = len(requests)
        s = smp.neutral_state(n, jnp.asarray(smp.neutral_rows(1, vocab, eos).eos_mask))
        self._eos = eos
        for r, (params, prompt, index) in enumerate(requests):
            s = self._put(s, r, params, prompt, index)
        return s

    def _put(self, s, r, params, prompt, index=0):
        jnp = self.jnp
        row = self.smp.request_row(params, prompt, int(s.eos_mask.shape[0]), self._eos)
        n = s.num_rows
        return self._install(s, self.jax.tree_util.tree_map(jnp.asarray, row), jnp.arange(n) == r,
                             jnp.full(n, index, jnp.int32))

    def install(self, s, row, params, prompt):
        return self._put(s, row, params, prompt)

    def record(self, s, tokens, mask):
        return self._record(s, self.jnp.asarray(tokens, self.jnp.int32), self.jnp.asarray(mask))

    def override(self, s, tokens, mask):
        return self._override(s, self.jnp.asarray(tokens, self.jnp.int32), self.jnp.asarray(mask))

    def sample(self, s, logits):
        out = self._sample(s, self.jnp.asarray(logits, self.jnp.float32), self.jnp.ones(logits.shape[0], bool),
                           num_top=20, candidates=self.candidates)
        return {k: np.asarray(getattr(out, k)) for k in ("tokens", "logprobs", "top_ids", "top_logprobs")}

    def stats(self, s):
        return np.asarray(s.counts), np.asarray(s.step), np.asarray(s.last_token)

    def state(self, s):
        return s  # immutable: the handle is the snapshot

    def same_state(self, a, b):
        leaves_a, leaves_b = self.jax.tree_util.tree_leaves(a), self.jax.tree_util.tree_leaves(b)
        return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b))

    def uniforms64(self, seeds, steps, samples, vocab):
        jnp, smp = self.jnp, self.smp
        lo, hi = zip(*(split_seed(s) for s in seeds))
        ctr = smp.counter_hi(jnp.asarray(steps, jnp.int32), jnp.asarray(samples, jnp.int32))
        with self.jax.enable_x64(True):
            return np.asarray(smp.uniforms(jnp.asarray(lo, jnp.uint32), jnp.asarray(hi, jnp.uint32),
                                           jnp.arange(vocab, dtype=jnp.uint32), ctr, dtype=jnp.float64))

    def gumbel_from_bits(self, bits):
        return np.asarray(_jax_jitted()["gumbel"](self.jnp.asarray(bits)), np.float64)

    def argmax_lowest(self, x):
        return np.asarray(self.smp.argmax_lowest(self.jnp.asarray(x))).tolist()

    def top_n(self, x, n):
        ids, vals = self.smp.top_n(self.jnp.asarray(x, self.jnp.float32), n)
        return np.asarray(ids), np.asarray(vals)


_JITTED: dict = {}


def _jax_jitted() -> dict:
    """The JAX port's steps, jitted once for the module (eager JAX would compile every
    primitive of a step separately)."""
    if not _JITTED:
        import jax

        from polyengine.backends.tpu_jax import sampling as smp

        _JITTED.update(sample=jax.jit(smp.sample, static_argnames=("num_top", "candidates")), install=jax.jit(smp.install),
                       record=jax.jit(smp.record), override=jax.jit(smp.override), gumbel=jax.jit(smp.gumbel_from_bits))
    return _JITTED


PORTS = {
    "torch-float32": lambda: TorchPort("float32"),
    "torch-float64": lambda: TorchPort("float64"),
    "cpu-kernel-float32": lambda: CpuKernelPort("float32"),
    "cpu-kernel-float64": lambda: CpuKernelPort("float64"),
    "jax-full-sort": lambda: JaxPort(3),
    "jax-candidates": lambda: JaxPort(64),
}


@pytest.fixture(scope="module")
def _quiet_backends():
    """Tiny tensors: one torch thread (a second gains nothing and waits at barriers on a
    shared two-core machine), and XLA without its optimizations (they cost more compile
    time than they save here)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    jax = pytest.importorskip("jax")
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)
    torch.set_num_threads(threads)


@pytest.fixture(params=sorted(PORTS))
def port(request, _quiet_backends):
    return PORTS[request.param]()


@pytest.fixture(params=["torch", "cpu-kernel", "jax"])
def stream_port(request, _quiet_backends):
    """One variant per port for the stream: its functions depend on neither the work
    dtype nor the candidates bound."""
    return {"torch": TorchPort, "cpu-kernel": CpuKernelPort}[request.param]("float32") if request.param != "jax" \
        else JaxPort(3)


# -- the stream --------------------------------------------------------------------------------


def test_uniforms_equal_the_core_bit_for_bit(stream_port):
    """Seeds over the full 64-bit range, every id of a 49152 vocabulary (0 and vocab-1
    included), steps and sample indices at both ends of their ranges."""
    port = stream_port
    rng = np.random.default_rng(1)
    seeds = edge_seeds(rng, 23)  # 32 rows
    steps = [0, 2**20 - 1, 0, 2**20 - 1] + [int(s) for s in rng.integers(0, 2**20, len(seeds) - 4)]
    samples = [0, 4095, 4095, 0] + [int(s) for s in rng.integers(0, 4096, len(seeds) - 4)]
    u64 = port.uniforms64(seeds, steps, samples, 49152)
    for row, (seed, step, index) in enumerate(zip(seeds, steps, samples)):
        ref = ref_threefry.uniforms(seed, np.arange(49152), step, index)
        assert np.array_equal(u64[row], ref), (seed, step, index)


def test_gumbel_is_finite_and_close_for_every_uniform(stream_port):
    """All 2**24 possible uniforms: float32 noise is finite (a plain float32 u would
    round the largest to 1.0, i.e. +inf noise) and within 1e-6 of the float64 value."""
    for chunk in range(4):
        bits = np.arange(chunk << 22, (chunk + 1) << 22, dtype=np.uint32)
        g32 = stream_port.gumbel_from_bits(bits)
        u = (bits.astype(np.float64) + 0.5) * 2.0**-24
        assert np.isfinite(g32).all()
        np.testing.assert_allclose(g32, -np.log(-np.log(u)), rtol=0, atol=1e-6)


def test_argmax_and_top_n_break_ties_to_the_lowest_id(stream_port):
    port = stream_port
    x = np.array([[1.0, 3.0, 3.0, 2.0, 3.0, 2.0], [0.0, -0.0, 0.0, -0.0, 0.0, 0.0], [np.nan] * 6], np.float32)
    assert port.argmax_lowest(x) == [1, 0, 5]  # a NaN row still yields an in-range id
    ids, _ = port.top_n(x[1:2], 6)
    assert ids.tolist() == [[0, 1, 2, 3, 4, 5]]  # -0.0 and 0.0 are one value
    vals = np.random.default_rng(2).integers(0, 5, (8, 40)).astype(np.float32)  # heavy ties
    for n in (1, 3, 7, 20, 40):
        ids, got = port.top_n(vals, n)
        for r in range(vals.shape[0]):
            want = _top_ids(vals[r].astype(np.float64), n)
            assert ids[r].tolist() == want.tolist(), (n, r)
            assert np.array_equal(got[r], vals[r][want])


# -- the sampler against the reference ----------------------------------------------------------


def _same_tops(raw_row, top_ids, k, exact) -> bool:
    """The reference's top ids; for a float32 port also swaps between log-probs equal
    within float32 noise (the reported values, descending, are the k largest)."""
    ids = np.asarray(top_ids[:k])
    if ids.tolist() == _top_ids(raw_row, k).tolist():
        return True
    vals = raw_row[ids]
    return not exact and bool(np.all(np.diff(vals) <= 1e-5) and np.all(np.abs(vals - np.sort(raw_row)[::-1][:k]) <= 1e-5))


def test_sampler_equals_the_reference(port):
    rng = np.random.default_rng(32)
    eos = (0, 5, _VOCAB - 1)  # several EOS ids, one at the vocabulary's end
    differ = total = 0
    for trial in range(30):
        reqs, recorded, rows, logits = random_requests(rng, _VOCAB, _ROWS)
        logits = logits if port.exact else logits.astype(np.float32)
        h = port.new(reqs, _VOCAB, eos)
        for toks in recorded:
            h = port.record(h, toks, np.ones(_ROWS, bool))
        ref = reference_sample(logits.astype(np.float64), rows, eos)
        out = port.sample(h, logits)
        raw = raw_logprobs(logits)
        for r, row in enumerate(rows):
            ours, theirs = int(out["tokens"][r]), int(ref.tokens[r])
            total += 1
            if ours != theirs:
                differ += 1
                assert not port.exact and float32_explains(logits[r].astype(np.float64), row, eos, ours, theirs), (
                    trial, r, row.params)
            tol = 1e-12 if port.exact else 1e-5
            assert abs(float(out["logprobs"][r]) - raw[r, ours]) <= tol * (1 + abs(raw[r, ours]))
            k = row.params.top_logprobs
            assert k == 0 or _same_tops(raw[r], out["top_ids"][r], k, port.exact), (trial, r)
    assert differ <= total // 20, f"{differ} of {total} tokens differ"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("vocab", [_VOCAB, 49152])
def test_the_cpu_kernels_plain_draw_is_the_references(vocab, isa, _quiet_backends):
    """Plain temperature sampling (no top-k, top-p or min-p: the cpu kernels' whole draw,
    csrc/threefry.h's gd_row, float64 with the noise only where a token can still win):
    the reference's token in every row, temperatures exact in float32 and at their edges
    (a tiny one draws among tied maxima), with penalties, a bias and EOS masking before it,
    a row whose logits are -inf but for a few, and greedy rows beside; each ISA path."""
    port = CpuKernelPort("float32", isa)
    rng = np.random.default_rng(7)
    eos = (0, 5)
    for trial in range(12):
        reqs, rows = [], []
        for r in range(_ROWS):
            kw = {"temperature": float(rng.choice([0.0, 1e-6, 0.125, 0.5, 1.0, 1.25, 2.0, 8.0])),
                  "seed": int(rng.integers(0, 2**63)), "min_tokens": int(rng.integers(0, 2))}
            if trial % 3 == 1:
                kw.update(repetition_penalty=1.25, presence_penalty=0.5, frequency_penalty=0.25,
                          logit_bias={3: 2.0, 4: -100.0})
            params, prompt = SamplingParams(**kw), rng.integers(0, vocab, 5)
            reqs.append((params, prompt, int(r % 2)))
            rows.append(RowState(params, int(r % 2), 0, prompt, np.zeros(0, np.int64)))
        logits = (rng.standard_normal((_ROWS, vocab)) * float(rng.choice([0.5, 3.0, 20.0]))).astype(np.float32)
        logits[:, 5] = logits[:, 9] = logits[:, 11] = logits.max(axis=1)  # exact ties at the top
        logits[0, 20:] = -np.inf  # a row with few finite logits
        h = port.new(reqs, vocab, eos)
        assert not (h.flags.top_k or h.flags.top_p or h.flags.min_p)
        ref = reference_sample(logits.astype(np.float64), rows, eos)
        assert port.sample(h, logits)["tokens"].tolist() == np.asarray(ref.tokens).tolist(), trial


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("vocab", [_VOCAB, 49152])
def test_the_cpu_kernels_filtered_draw_is_the_references(vocab, isa, _quiet_backends):
    """Top-k, top-p and min-p on the cpu kernels (csrc/threefry.h's fd_row: the core's
    steps 3-5 in float64 over lists of kept ids): the reference's token in every row, each
    filter at its edges (top_k 1 and V - 1, top_p just under 1, min_p 0.5) and together,
    tied maxima, a row of few finite logits, greedy rows beside; each ISA path."""
    port = CpuKernelPort("float32", isa)
    rng = np.random.default_rng(3)
    for trial in range(16):
        reqs, rows = [], []
        for r in range(_ROWS):
            params = SamplingParams(temperature=float(rng.choice([0.0, 1e-6, 0.125, 0.5, 1.0, 2.0])),
                                    seed=int(rng.integers(0, 2**63)),
                                    top_k=int(rng.choice([0, 1, 5, 40, vocab - 1, vocab])),
                                    top_p=float(rng.choice([1.0, 0.5, 0.9, 0.999, 0.125])),
                                    min_p=float(rng.choice([0.0, 0.0, 0.05, 0.5])))
            prompt = rng.integers(0, vocab, 4)
            reqs.append((params, prompt, 0))
            rows.append(RowState(params, 0, 0, prompt, np.zeros(0, np.int64)))
        logits = (rng.standard_normal((_ROWS, vocab)) * float(rng.choice([0.5, 3.0, 20.0]))).astype(np.float32)
        logits[:, 5] = logits[:, 9] = logits.max(axis=1)  # exact ties at the top
        logits[1, 30:] = -np.inf  # a row with few finite logits
        h = port.new(reqs, vocab, (0,))
        ref = reference_sample(logits.astype(np.float64), rows, (0,))
        assert port.sample(h, logits)["tokens"].tolist() == np.asarray(ref.tokens).tolist(), trial


def test_tiny_temperature_draws_among_tied_maxima_like_the_reference(port):
    """temperature 1e-30 (below float32's normal range) is not greedy: the draw decides
    between tied maxima, as in the reference."""
    logits = np.zeros((_ROWS, _VOCAB), np.float32)
    logits[:, [7, 11, 30]] = 2.0
    params = [SamplingParams(temperature=1e-30, seed=1000 + r) for r in range(_ROWS)]
    h = port.new([(p, np.zeros(0, np.int64), 0) for p in params], _VOCAB, ())
    out = port.sample(h, logits)
    ref = reference_sample(logits.astype(np.float64), [RowState(p) for p in params], ())
    assert out["tokens"].tolist() == ref.tokens.tolist()
    assert set(ref.tokens.tolist()) - {7}, "the test needs a draw that is not the lowest id"


def test_override_counts_the_forced_token_not_the_sampled_one(port):
    eos = (1,)
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=1.5, repetition_penalty=1.7, seed=3)
    other = (SamplingParams(seed=0), np.zeros(0, np.int64), 0)
    h = port.new([other, (params, np.array([4, 5]), 0)] + [other] * (_ROWS - 2), _VOCAB, eos)
    row = RowState(params, 0, 0, np.array([4, 5]), np.zeros(0, np.int64))
    logits = np.linspace(-1.0, 1.0, _VOCAB, dtype=np.float32)[None].repeat(_ROWS, 0)
    live = np.arange(_ROWS) == 1
    for tok, forced in [(127, None), (127, 126), (126, None), (20, 125)]:
        h = port.record(h, np.full(_ROWS, tok), live)
        row.completion_tokens = np.append(row.completion_tokens, tok)
        if forced is not None:
            h = port.override(h, np.full(_ROWS, forced), live)
            row.completion_tokens[-1] = forced
        row.step = len(row.completion_tokens)
        got = int(port.sample(h, logits)["tokens"][1])
        assert got == int(reference_sample(logits[:1].astype(np.float64), [row], eos).tokens[0])
    counts, step, last = port.stats(h)
    assert step.tolist() == [0, 4] + [0] * (_ROWS - 2)
    assert counts[1].tolist() == np.bincount(row.completion_tokens, minlength=_VOCAB).tolist()  # forced ones count
    assert int(last[1]) == 125


@pytest.mark.parametrize(("params", "prompt"), [
    (SamplingParams(), [1]),  # no seed
    (SamplingParams(seed=1, logit_bias={4: 1.0}), [1]),
    (SamplingParams(seed=1, stop_token_ids=[9]), [1]),
    (SamplingParams(seed=1), [1, 4]),
    (SamplingParams(seed=1, min_tokens=1, stop_token_ids=[2, 3]), []),  # all four masked
], ids=["no-seed", "bias-id", "stop-id", "prompt-id", "all-masked"])
def test_install_refuses_what_a_step_could_not_and_changes_nothing(port, params, prompt):
    """The core's request_row makes every refusal (one place for both ports); the
    port's state is as it was."""
    h = port.new([(SamplingParams(seed=7), [1], 0), (SamplingParams(seed=8), [2], 0)], 4, (0, 1))
    before = port.state(h)
    with pytest.raises(InvalidRequest):
        port.install(h, 0, params, prompt)
    assert port.same_state(before, port.state(h))
