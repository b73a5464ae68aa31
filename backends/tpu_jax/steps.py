"""The engine's work as pure functions under ``jax.jit``: (params, state, inputs) -> (state, outputs).

The model is the shared PyTorch forward (``polyengine.backends.torch_common.model``)
run through torchax: :func:`run_model` hands JAX arrays to it as torch tensors and
gets JAX arrays back, so the same definition the torch backends run is traced into
each XLA program. Sampling (:mod:`.sampling`) runs on the devices too: inside
:func:`generate_step` for every slot, and in :func:`first_token_step` for a request's
first token (prefill's, each sample of a bulk insert, an imported prefix's). That
program is shared by every bucket and model with the same vocabulary: on the CPU
the sampler costs more compile time than a small model does, so one copy of it
instead of one per prefill bucket halves warm-up; prefill and first token are
dispatched back to back, with no host sync between them.

Compilation: every step is a module-level function jitted with its static config
as a static argument (hashable: model config, dtype, quantization, the sharding plan),
so executables are shared by every engine with the same config. The work is split by
what it depends on, because each program is traced and compiled once per distinct
static config and on the CPU (the conformance suite builds ~30 engines of a dozen tiny
models) compiling, not running, is what an engine costs:

- the model's programs (:class:`StepConfig`): prefill once per (new tokens bucket,
  output bucket), a plain prefill being the continuation of an empty prefix (so the
  continuations that land in a bucket share the prefills' executables), a batch of
  prefills once per (rows, new tokens bucket, output bucket) (:func:`prefill_batch_step`,
  option ``batched_prefill``), the KV half of
  insert once per prefill bucket, the decode forward once; copying a prefix into a
  fresh cache of the output bucket (:func:`widen_prefix`) is a tiny program per K/V
  shape, shared by models whose K/V shapes agree;
- the slot rows' programs (:class:`SampleConfig`: vocabulary, slots and mesh, never the
  model): the first token, the sampling half of a decode step, the rows half of insert,
  the empty rows and free. The sampler costs more to compile than a small model's
  forward (first token ~9 s against prefill's ~5-8 s of wall time on this CPU), so one
  copy of it per vocabulary instead of one per model and bucket halves an engine's
  compile time when another engine compiled them already.

A decode step is therefore two dispatches back to back (:func:`generate_step`: forward,
then sample), with no host sync between them and the logits (R, V) float32 passed on
the devices. Steps that update the decode state donate it (``donate_argnames``): XLA
writes the KV cache and the rows in place. After :meth:`TpuJaxEngine.warmup
<polyengine.backends.tpu_jax.engine.TpuJaxEngine.warmup>` nothing compiles again,
whatever the mix of requests: sampling parameters are arrays, and the fast paths are
``lax.cond`` branches inside one program.

Results leave a step as one packed int32 buffer in the protocol's ``ResultLayout``
(:func:`pack`): one host transfer per step. The host passes only small arrays in
(padded tokens, masks, one request's sampling row); the decode state never leaves
the devices.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
from jax import lax

from polyengine.engine import ResultLayout
from polyengine.models import ModelConfig

from polyengine.backends.tpu_jax import sampling as smp
from polyengine.backends.tpu_jax.compat import import_torchax
from polyengine.backends.tpu_jax.footprint import CACHE_AXES
from polyengine.backends.tpu_jax.quantize import KV_SCALE_BYTES, Int8KVCodec, int8_linear, kv_encode
from polyengine.backends.tpu_jax.sharding import ShardingPlan
from polyengine.backends.tpu_jax.xla_flags import prefer_memory_scheduler

# XLA:CPU's memory-minimizing scheduler for every program below (xla_flags.py): what was done.
XLA_CPU_SCHEDULER = prefer_memory_scheduler()

__all__ = [
    "StepConfig", "CacheConfig", "SampleConfig", "SlotRows", "DecodeArrays", "run_model", "pack", "init_state", "init_cache", "init_rows",
    "widen_prefix", "prefill_step", "prefill_batch_step", "first_token_step", "insert_step", "insert_kv_step", "insert_rows_step",
    "generate_step", "forward_step", "sample_step", "free_step", "free_rows_step", "JAX_DTYPES",
]

JAX_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass(frozen=True)
class StepConfig:
    """Everything static about an engine's programs (a jit static argument)."""

    model: ModelConfig
    dtype: str  # compute dtype of weights, activations and (unless int8) the KV cache
    slots: int
    cache_length: int
    plan: ShardingPlan
    attention: str = "sdpa"
    quantize: str = ""  # int8 weights: "", "int8", "int8-block32"
    blocks: bool = False  # some matrices are a file's GGUF blocks (quantize.block_arrays)
    kv_int8: bool = False
    num_top: int = 20  # width of the top log-probs every result carries
    candidates: int = 64  # top-k bound under which the filters skip the full sort

    @property
    def sampler(self) -> SampleConfig:
        return SampleConfig(self.plan, self.num_top, self.candidates)

    @property
    def cache(self) -> CacheConfig:
        c = self.model
        return CacheConfig(self.plan, c.num_hidden_layers, self.slots, c.num_key_value_heads, self.cache_length,
                           c.head_dim, self.dtype, self.kv_int8)

    @property
    def layout(self) -> ResultLayout:
        return ResultLayout(k=1, top_n=self.num_top, logprobs=True)

    @property
    def jax_dtype(self):
        return JAX_DTYPES[self.dtype]

    @property
    def cache_dtype(self):
        return jnp.int8 if self.kv_int8 else self.jax_dtype

    @property
    def precision(self) -> str:
        # float32 means float32 products; TPUs otherwise use bf16 passes for them.
        return "highest" if self.dtype == "float32" else "default"


@dataclass(frozen=True)
class CacheConfig:
    """What the KV cache's programs depend on (its shape, dtype and layout, not the rest
    of the model: shared by every model whose K/V shapes agree)."""

    plan: ShardingPlan
    layers: int
    slots: int
    kv_heads: int
    cache_length: int
    head_dim: int
    dtype: str  # compute dtype (of prefixes, and of the cache unless int8)
    kv_int8: bool = False

    @property
    def cache_dtype(self):
        return jnp.int8 if self.kv_int8 else JAX_DTYPES[self.dtype]


@dataclass(frozen=True)
class SampleConfig:
    """What the slot rows' programs depend on (not the model: shared across models)."""

    plan: ShardingPlan
    num_top: int
    candidates: int


@jax.tree_util.register_dataclass
@dataclass
class SlotRows:
    """The model-independent half of a decode state (``R`` slots): what the slot rows'
    programs read and write."""

    next_tokens: jax.Array  # (R,) int32, what each slot feeds next
    prompt_len: jax.Array  # (R,) int32
    completion: jax.Array  # (R,) int32, completion tokens so far (forced ones included)
    occupied: jax.Array  # (R,) bool
    sampler: smp.SamplerState


@jax.tree_util.register_dataclass
@dataclass
class DecodeArrays:
    """The device half of a decode state (``R`` slots): the model's KV cache and the rows."""

    k: jax.Array | None  # (layers, R, kv_heads, cache_length, head_dim): compute dtype; int8: head_dim + 4 (scales)
    v: jax.Array | None  # paged (option page_size): None, the K/V live in the engine's page pools (paged.py)
    rows: SlotRows
    table: jax.Array | None = None  # paged: (R, pages per context) int32, each slot's page ids


# Logical axes of each decode-state field (sharding.py maps them to the mesh).
_CACHE_AXES = CACHE_AXES  # the cache is laid out by the axes the memory check counts


def _constrain_cache(cfg: StepConfig | CacheConfig, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Pin the cache to its layout, so a donated input and its output agree."""
    return cfg.plan.constrain(k, _CACHE_AXES), cfg.plan.constrain(v, _CACHE_AXES)


def _constrain_rows(cfg: SampleConfig, s: SlotRows) -> SlotRows:
    """Pin every row array to its layout, so a donated input and its output agree."""
    p = cfg.plan
    sampler = {}
    for name in smp.ROW_FIELDS:
        x = getattr(s.sampler, name)
        sampler[name] = p.constrain(x, ("slots",) + ("vocab",) * (x.ndim - 1))
    sampler = smp.SamplerState(**sampler, eos_mask=p.constrain(s.sampler.eos_mask, ("vocab",)))
    return SlotRows(
        next_tokens=p.constrain(s.next_tokens, ("slots",)), prompt_len=p.constrain(s.prompt_len, ("slots",)),
        completion=p.constrain(s.completion, ("slots",)), occupied=p.constrain(s.occupied, ("slots",)),
        sampler=sampler,
    )


# -- the model ------------------------------------------------------------------------------


def run_model(cfg: StepConfig, params, tokens, positions, k, v, *, write_mask, logits_at=None, int8_cache=False,
              page_table=None, paged_kernel="gather"):
    """The shared torch forward on JAX arrays (traced by torchax): ``(logits, k, v)``.
    ``int8_cache``: ``k``/``v`` hold :func:`~.quantize.kv_encode`'d values. ``page_table``
    (B, W) int32: ``k``/``v`` are page pools (:mod:`.paged`) read and written through it,
    decode attention on the Pallas kernel where ``paged_kernel`` says (``"gather"``, ``"pallas"``
    or ``"interpret"``: :func:`.pallas.resolve`; a static argument of the paged decode step
    alone, so every other program is shared by engines that differ only in it)."""
    import_torchax()
    from torchax.interop import call_torch

    from polyengine.backends.torch_common.model import StepSpec, TorchWeights, forward

    kernel = None
    if page_table is not None and paged_kernel != "gather":
        from polyengine.backends.tpu_jax.pallas import torch_hook

        kernel = torch_hook(cfg.plan, interpret=paged_kernel == "interpret")
    spec = StepSpec(attention=cfg.attention, linear=int8_linear if cfg.quantize or cfg.blocks else None,
                    kv_codec=Int8KVCodec(cfg.jax_dtype) if int8_cache else None, page_layout="heads",
                    paged_attention=kernel)

    def torch_side(tensors, tokens, positions, k, v, write_mask, logits_at, page_table):
        return forward(TorchWeights(cfg.model, tensors), spec, tokens, positions, k, v, write_mask=write_mask,
                       logits_at=logits_at, page_table=page_table)

    with jax.default_matmul_precision(cfg.precision):
        return call_torch(torch_side, params, tokens, positions, k, v, write_mask, logits_at, page_table)


def pack(cfg: StepConfig | SampleConfig, res: smp.SampleResult, valid: jax.Array, lengths: jax.Array) -> jax.Array:
    """One step's results as the protocol's packed int32 buffer (rows, width), replicated
    (every process of a multi-host mesh can read it)."""
    bits = lambda x: lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)  # noqa: E731
    out = jnp.concatenate([
        res.tokens[:, None].astype(jnp.int32), valid[:, None].astype(jnp.int32), lengths[:, None].astype(jnp.int32),
        bits(res.logprobs)[:, None], res.top_ids.astype(jnp.int32), bits(res.top_logprobs),
    ], axis=1)
    return cfg.plan.constrain(out)


def _jit(fn=None, *, donate=()):
    if fn is None:
        return functools.partial(_jit, donate=donate)
    return jax.jit(fn, static_argnames=("cfg",), donate_argnames=donate)


# -- the steps --------------------------------------------------------------------------------


def init_state(eos_mask, *, cfg: StepConfig) -> DecodeArrays:
    """Every slot empty: zero caches, neutral sampler rows."""
    k, v = init_cache(cfg=cfg.cache)
    return DecodeArrays(k=k, v=v, rows=init_rows(eos_mask, cfg=cfg.sampler, slots=cfg.slots))


@_jit
def init_cache(*, cfg: CacheConfig) -> tuple[jax.Array, jax.Array]:
    width = cfg.head_dim + (KV_SCALE_BYTES if cfg.kv_int8 else 0)
    shape = (cfg.layers, cfg.slots, cfg.kv_heads, cfg.cache_length, width)
    return _constrain_cache(cfg, jnp.zeros(shape, cfg.cache_dtype), jnp.zeros(shape, cfg.cache_dtype))


@functools.partial(jax.jit, static_argnames=("cfg", "slots"))
def init_rows(eos_mask, *, cfg: SampleConfig, slots: int) -> SlotRows:
    zeros = jnp.zeros(slots, jnp.int32)
    rows = SlotRows(next_tokens=zeros, prompt_len=zeros, completion=zeros, occupied=jnp.zeros(slots, bool),
                    sampler=smp.neutral_state(slots, eos_mask))
    return _constrain_rows(cfg, rows)


@functools.partial(jax.jit, static_argnames=("plan", "bucket"))
def widen_prefix(prefix_k, prefix_v, *, plan: ShardingPlan, bucket: int):
    """A fresh prefill cache of ``bucket`` positions holding a prefix's K/V
    ``(layers, kv_heads, P, head_dim)`` at positions ``0 .. P-1`` and zeros after: the
    input :func:`prefill_step` writes into (and donates). ``P`` is 0 for a plain
    prefill (the engine's empty prefix), else the continued prefix's bucket. The prefix
    is read, never written: it stays valid after it was continued. One tiny program
    per (``P``, ``bucket``) and K/V shape, whatever the model's other dimensions."""
    axes = ("layers", "kv_heads", "positions", "head_dim")
    shape = prefix_k.shape[:2] + (bucket,) + prefix_k.shape[3:]
    put = lambda x: plan.constrain(lax.dynamic_update_slice(jnp.zeros(shape, x.dtype), x, (0, 0, 0, 0)), axes)  # noqa: E731
    return put(prefix_k), put(prefix_v)


@_jit(donate=("k", "v"))
def prefill_step(params, k, v, start, tokens, length, *, cfg: StepConfig):
    """Run one prompt, padded to its bucket ``T``, after ``start`` positions of a prefix:
    a plain prefill (``start`` 0, an empty cache) and the continuation of a prefix
    (``existing_prefix``) are the same program. ``k``/``v`` (layers, kv_heads, O,
    head_dim) come from :func:`widen_prefix` (donated: written in place); ``tokens``
    (T,) hold ``length`` live tokens, which go to positions ``start ..``. Returns K/V
    ``(layers, kv_heads, O, head_dim)`` holding ``start + length`` live positions (pad
    positions never written) and the last live token's raw logits (vocab,) float32; its
    first token comes from :func:`first_token_step`, dispatched right after.

    One program per (``T``, ``O``): the engine stores a continued prefix in the bucket
    ``O`` that holds the prefix's bucket and ``T`` (:meth:`TpuJaxEngine.continued_bucket
    <polyengine.backends.tpu_jax.engine.TpuJaxEngine.continued_bucket>`), a plain
    prefill in ``O == T``; the prefix's own bucket is :func:`widen_prefix`'s business,
    so the pairs that land in one (``T``, ``O``) share one executable.
    """
    t = tokens.shape[0]
    axes = ("layers", None, "kv_heads", "positions", "head_dim")
    k0, v0 = cfg.plan.constrain(k[:, None], axes), cfg.plan.constrain(v[:, None], axes)
    # Live positions stay below start + length <= O; a pad token's position may pass it
    # (its RoPE row is clamped and its K/V write is redirected: it changes nothing).
    index = jnp.arange(t, dtype=jnp.int32)
    logits, k, v = run_model(
        cfg, params, tokens[None], (start + index)[None], k0, v0, write_mask=(index < length)[None],
        logits_at=(length - 1)[None])
    axes = ("layers", "kv_heads", "positions", "head_dim")
    return cfg.plan.constrain(k[:, 0], axes), cfg.plan.constrain(v[:, 0], axes), cfg.plan.constrain(logits[0].astype(jnp.float32))


@_jit
def prefill_batch_step(params, ks, vs, starts, tokens, lengths, *, cfg: StepConfig):
    """:func:`prefill_step` for ``B`` rows in one forward (capability ``batched_prefill``):
    row ``b`` is one prompt or piece, ``tokens[b]`` (T,) holding ``lengths[b]`` live
    tokens that go to positions ``starts[b] ..`` after its own prefix, ``ks[b]``/``vs[b]``
    (layers, kv_heads, O, head_dim) from :func:`widen_prefix`. Each row's queries attend
    only its own cache row, keyed by their own positions (the decode forward's batch of
    rows). A pad row (``lengths[b]`` 0) writes nothing and its results are dropped.
    Returns per row its K/V ``(layers, kv_heads, O, head_dim)`` and last live token's
    logits (vocab,) float32, as tuples (a row taken outside the program would be a
    program of its own to compile).

    One program per (``B``, ``T``, ``O``); the inputs are not donated (they are stacked
    into the batch's cache, which no input can alias)."""
    b, t = tokens.shape
    axes = ("layers", None, "kv_heads", "positions", "head_dim")
    k = cfg.plan.constrain(jnp.stack(ks, axis=1), axes)  # (layers, B, kv_heads, O, head_dim)
    v = cfg.plan.constrain(jnp.stack(vs, axis=1), axes)
    index = jnp.arange(t, dtype=jnp.int32)
    logits, k, v = run_model(
        cfg, params, tokens, starts[:, None] + index[None], k, v, write_mask=index[None] < lengths[:, None],
        logits_at=jnp.maximum(lengths - 1, 0))  # logits (B, vocab)
    axes = ("layers", "kv_heads", "positions", "head_dim")
    logits = logits.astype(jnp.float32)
    return (tuple(cfg.plan.constrain(k[:, i], axes) for i in range(b)),
            tuple(cfg.plan.constrain(v[:, i], axes) for i in range(b)),
            tuple(cfg.plan.constrain(logits[i]) for i in range(b)))


@functools.partial(jax.jit, static_argnames=("cfg",))
def first_token_step(logits, row: smp.SamplerState, token_mask, *, cfg: SampleConfig):
    """A request's first token from its prefix's logits (vocab,): the one-row packed result
    for the sample ``row`` names (step 0), under ``token_mask`` (1, W) (all bits set: no
    mask). One executable per vocabulary size serves prefill, bulk_insert (one call per
    sample) and imported prefixes, so the same logits and seed give the same first token
    on every path."""
    res = smp.sample(row, logits[None].astype(jnp.float32), jnp.ones(1, bool), num_top=cfg.num_top,
                     candidates=cfg.candidates, token_mask=token_mask)
    one = jnp.ones(1, jnp.int32)
    return pack(cfg, res, one, one)


def insert_step(state: DecodeArrays, prefix_k, prefix_v, length, row: smp.SamplerState, slots, count,
                mask, sample_index, first, *, cfg: StepConfig) -> DecodeArrays:
    """Install one prefix into ``slots[:count]`` (insert and bulk_insert): its K/V
    (:func:`insert_kv_step`, per K/V shape and bucket), then its rows
    (:func:`insert_rows_step`, per vocabulary). ``state`` is donated.

    ``prefix_k``/``prefix_v`` (layers, kv_heads, T, head_dim) hold ``length`` live
    positions; ``slots`` (R,) lists the target slots first; ``mask`` (R,) marks them,
    ``sample_index`` (R,) gives each its sample and ``first`` (R,) its first token
    (drawn by :func:`first_token_step`), which it feeds next.
    """
    k, v = insert_kv_step(state.k, state.v, prefix_k, prefix_v, slots, count, cfg=cfg.cache)
    rows = insert_rows_step(state.rows, length, row, mask, sample_index, first, cfg=cfg.sampler)
    return DecodeArrays(k=k, v=v, rows=rows)


@_jit(donate=("k", "v"))
def insert_kv_step(k, v, prefix_k, prefix_v, slots, count, *, cfg: CacheConfig):
    """Copy a prefix's K/V into the cache rows ``slots[:count]``."""
    encode = kv_encode if cfg.kv_int8 else (lambda x: x.astype(cfg.cache_dtype))
    new_k, new_v = encode(prefix_k), encode(prefix_v)

    # Positions past the prefix keep stale values: a slot writes each position before
    # any query of its own reads it, so they are never seen.
    def copy(i, kv):
        at = (0, slots[i], 0, 0, 0)
        return (lax.dynamic_update_slice(kv[0], new_k[:, None], at), lax.dynamic_update_slice(kv[1], new_v[:, None], at))

    return _constrain_cache(cfg, *lax.fori_loop(0, count, copy, (k, v)))


@_jit(donate=("rows",))
def insert_rows_step(rows: SlotRows, length, row: smp.SamplerState, mask, sample_index, first, *,
                     cfg: SampleConfig) -> SlotRows:
    """Start the masked rows: the request's sampler row, each its sample index, the
    prompt length, the first token fed next and counted."""
    sampler = smp.record(smp.install(rows.sampler, row, mask, sample_index), first, mask)
    rows = SlotRows(
        next_tokens=jnp.where(mask, first, rows.next_tokens), prompt_len=jnp.where(mask, length, rows.prompt_len),
        completion=jnp.where(mask, 1, rows.completion), occupied=rows.occupied | mask, sampler=sampler,
    )
    return _constrain_rows(cfg, rows)


def _live(rows: SlotRows, cache_length: int) -> jax.Array:
    """The slots a decode step advances: occupied, their cache not full."""
    return rows.occupied & (rows.prompt_len + rows.completion < cache_length)


def generate_step(params, state: DecodeArrays, override_tokens, override_mask, token_mask, *, cfg: StepConfig):
    """One decode step for every occupied slot (its cache not full), overrides first;
    ``token_mask`` (R, W) int32 allowed-token words (all bits set where a slot has none).
    The model's forward (:func:`forward_step`), then the sampler (:func:`sample_step`),
    dispatched back to back; ``state`` is donated. Returns (state, packed results)."""
    logits, live, k, v = forward_step(params, state.k, state.v, state.rows, override_tokens, override_mask, cfg=cfg)
    rows, packed = sample_step(state.rows, logits, live, override_tokens, override_mask, token_mask, cfg=cfg.sampler)
    return DecodeArrays(k=k, v=v, rows=rows), packed


@_jit(donate=("k", "v"))
def forward_step(params, k, v, rows: SlotRows, override_tokens, override_mask, *, cfg: StepConfig):
    """The decode forward: each live slot's next token (the override where there is one)
    at its latest position. Returns its logits (R, V) float32, the live mask (R,) and
    the cache; ``rows`` is read, not written."""
    feed = jnp.where(override_mask, override_tokens, rows.next_tokens)
    live = _live(rows, cfg.cache_length)
    positions = jnp.maximum(rows.prompt_len + rows.completion - 1, 0)  # the latest token's; empty rows: 0 (not written)
    logits, k, v = run_model(
        cfg, params, feed[:, None], positions[:, None], k, v, write_mask=live[:, None], int8_cache=cfg.kv_int8)
    logits = cfg.plan.constrain(logits[:, 0].astype(jnp.float32), ("slots", "vocab"))
    return logits, cfg.plan.constrain(live, ("slots",)), *_constrain_cache(cfg, k, v)


@_jit(donate=("rows",))
def sample_step(rows: SlotRows, logits, live, override_tokens, override_mask, token_mask, *, cfg: SampleConfig):
    """The sampling half of a decode step: overrides first, then one token per ``live``
    slot from ``logits`` (R, V), recorded and fed next. Returns (rows, packed results)."""
    sampler = smp.override(rows.sampler, override_tokens, override_mask)
    feed = jnp.where(override_mask, override_tokens, rows.next_tokens)
    res = smp.sample(sampler, logits, live, num_top=cfg.num_top, candidates=cfg.candidates, token_mask=token_mask)
    sampler = smp.record(sampler, res.tokens, live)
    completion = rows.completion + live.astype(jnp.int32)
    rows = replace(rows, next_tokens=jnp.where(live, res.tokens, feed), completion=completion, sampler=sampler)
    packed = pack(cfg, res, live, jnp.where(rows.occupied, completion, 0))
    return _constrain_rows(cfg, rows), packed


def free_step(state: DecodeArrays, slot, *, cfg: StepConfig) -> DecodeArrays:
    """Empty one slot (its cache and sampler row are overwritten at the next insert)."""
    return DecodeArrays(k=state.k, v=state.v, rows=free_rows_step(state.rows, slot, cfg=cfg.sampler), table=state.table)


@_jit(donate=("rows",))
def free_rows_step(rows: SlotRows, slot, *, cfg: SampleConfig) -> SlotRows:
    return _constrain_rows(cfg, replace(rows, occupied=rows.occupied.at[slot].set(False)))
