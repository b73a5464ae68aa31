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

Compilation: every step is a module-level function jitted with :class:`StepConfig` as
a static argument (hashable: model config, dtype, quantization, the sharding plan),
so executables are shared by every engine with the same config, and prefill and insert
are built once per prefill bucket (the bucket is the padded prompt's shape), the
continuation of a prefix once per (prefix bucket, new tokens bucket). Steps that update the
decode state donate it (``donate_argnames="state"``): XLA writes the KV cache in
place. After :meth:`TpuJaxEngine.warmup <polyengine.backends.tpu_jax.engine.TpuJaxEngine.warmup>`
nothing compiles again, whatever the mix of requests: sampling parameters are arrays,
and the fast paths are ``lax.cond`` branches inside one program.

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

__all__ = [
    "StepConfig", "SampleConfig", "DecodeArrays", "run_model", "pack", "init_state", "prefill_step", "continue_step",
    "insert_step",
    "generate_step", "free_step", "first_token_step", "JAX_DTYPES",
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
class SampleConfig:
    """What the first-token program depends on (not the model: shared across models)."""

    plan: ShardingPlan
    num_top: int
    candidates: int


@jax.tree_util.register_dataclass
@dataclass
class DecodeArrays:
    """The device half of a decode state (``R`` slots)."""

    k: jax.Array  # (layers, R, kv_heads, cache_length, head_dim): compute dtype; int8: head_dim + 4 (scales)
    v: jax.Array
    next_tokens: jax.Array  # (R,) int32, what each slot feeds next
    prompt_len: jax.Array  # (R,) int32
    completion: jax.Array  # (R,) int32, completion tokens so far (forced ones included)
    occupied: jax.Array  # (R,) bool
    sampler: smp.SamplerState


# Logical axes of each decode-state field (sharding.py maps them to the mesh).
_CACHE_AXES = CACHE_AXES  # the cache is laid out by the axes the memory check counts


def _constrain_state(cfg: StepConfig, s: DecodeArrays) -> DecodeArrays:
    """Pin every state array to its layout, so a donated input and its output agree."""
    p = cfg.plan
    sampler = {}
    for name in smp.ROW_FIELDS:
        x = getattr(s.sampler, name)
        sampler[name] = p.constrain(x, ("slots",) + ("vocab",) * (x.ndim - 1))
    sampler = smp.SamplerState(**sampler, eos_mask=p.constrain(s.sampler.eos_mask, ("vocab",)))
    return DecodeArrays(
        k=p.constrain(s.k, _CACHE_AXES), v=p.constrain(s.v, _CACHE_AXES),
        next_tokens=p.constrain(s.next_tokens, ("slots",)), prompt_len=p.constrain(s.prompt_len, ("slots",)),
        completion=p.constrain(s.completion, ("slots",)), occupied=p.constrain(s.occupied, ("slots",)),
        sampler=sampler,
    )


# -- the model ------------------------------------------------------------------------------


def run_model(cfg: StepConfig, params, tokens, positions, k, v, *, write_mask, logits_at=None, int8_cache=False):
    """The shared torch forward on JAX arrays (traced by torchax): ``(logits, k, v)``.
    ``int8_cache``: ``k``/``v`` hold :func:`~.quantize.kv_encode`'d values."""
    import_torchax()
    from torchax.interop import call_torch

    from polyengine.backends.torch_common.model import StepSpec, TorchWeights, forward

    spec = StepSpec(attention=cfg.attention, linear=int8_linear if cfg.quantize or cfg.blocks else None,
                    kv_codec=Int8KVCodec(cfg.jax_dtype) if int8_cache else None)

    def torch_side(tensors, tokens, positions, k, v, write_mask, logits_at):
        return forward(TorchWeights(cfg.model, tensors), spec, tokens, positions, k, v, write_mask=write_mask,
                       logits_at=logits_at)

    with jax.default_matmul_precision(cfg.precision):
        return call_torch(torch_side, params, tokens, positions, k, v, write_mask, logits_at)


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


@_jit
def init_state(eos_mask, *, cfg: StepConfig) -> DecodeArrays:
    """Every slot empty: zero caches, neutral sampler rows."""
    c, r = cfg.model, cfg.slots
    width = c.head_dim + (KV_SCALE_BYTES if cfg.kv_int8 else 0)
    shape = (c.num_hidden_layers, r, c.num_key_value_heads, cfg.cache_length, width)
    sampler = smp.neutral_state(r, eos_mask)
    zeros = jnp.zeros(r, jnp.int32)
    state = DecodeArrays(
        k=jnp.zeros(shape, cfg.cache_dtype), v=jnp.zeros(shape, cfg.cache_dtype),
        next_tokens=zeros, prompt_len=zeros, completion=zeros, occupied=jnp.zeros(r, bool), sampler=sampler,
    )
    return _constrain_state(cfg, state)


@_jit
def prefill_step(params, tokens, length, *, cfg: StepConfig):
    """Run one prompt, padded to its bucket ``T``: ``tokens`` (T,) int32, ``length`` ()
    the true length. Returns the prefix K/V ``(layers, kv_heads, T, head_dim)`` (pad
    positions never written) and the last position's raw logits (vocab,) float32; its
    first token comes from :func:`first_token_step`, dispatched right after."""
    c, t = cfg.model, tokens.shape[0]
    shape = (c.num_hidden_layers, 1, c.num_key_value_heads, t, c.head_dim)
    k0 = cfg.plan.constrain(jnp.zeros(shape, cfg.jax_dtype), ("layers", None, "kv_heads", "positions", "head_dim"))
    positions = jnp.arange(t, dtype=jnp.int32)
    logits, k, v = run_model(
        cfg, params, tokens[None], positions[None], k0, k0, write_mask=(positions < length)[None],
        logits_at=(length - 1)[None])
    axes = ("layers", "kv_heads", "positions", "head_dim")
    return cfg.plan.constrain(k[:, 0], axes), cfg.plan.constrain(v[:, 0], axes), cfg.plan.constrain(logits[0].astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("cfg", "out_bucket"))
def continue_step(params, prefix_k, prefix_v, start, tokens, length, *, cfg: StepConfig, out_bucket: int):
    """Continue a prefix with more prompt tokens (``existing_prefix``): one program per
    (prefix bucket ``P``, new tokens bucket ``T``), whose output bucket ``out_bucket`` the
    engine derives from that pair (:meth:`TpuJaxEngine.continued_bucket`), so the pair
    alone picks the program.

    ``prefix_k``/``prefix_v`` (layers, kv_heads, P, head_dim) hold ``start`` live
    positions; ``tokens`` (T,) hold ``length`` live tokens, which go to positions
    ``start ..``. Returns K/V ``(layers, kv_heads, out_bucket, head_dim)`` holding
    ``start + length`` live positions, and the last live token's raw logits (vocab,).
    The prefix's arrays are read, never written (a prefix stays valid after it was
    continued): the program copies them into a fresh cache of ``out_bucket`` positions.
    """
    c, t = cfg.model, tokens.shape[0]
    axes = ("layers", None, "kv_heads", "positions", "head_dim")
    shape = (c.num_hidden_layers, 1, c.num_key_value_heads, out_bucket, c.head_dim)
    put = lambda x: cfg.plan.constrain(lax.dynamic_update_slice(  # noqa: E731
        jnp.zeros(shape, cfg.jax_dtype), x[:, None].astype(cfg.jax_dtype), (0, 0, 0, 0, 0)), axes)
    k0, v0 = put(prefix_k), put(prefix_v)
    # Live positions stay below start + length <= out_bucket; a pad token's position may
    # pass it (its RoPE row is clamped and its K/V write is redirected: it changes nothing).
    index = jnp.arange(t, dtype=jnp.int32)
    logits, k, v = run_model(
        cfg, params, tokens[None], (start + index)[None], k0, v0, write_mask=(index < length)[None],
        logits_at=(length - 1)[None])
    axes = ("layers", "kv_heads", "positions", "head_dim")
    return cfg.plan.constrain(k[:, 0], axes), cfg.plan.constrain(v[:, 0], axes), cfg.plan.constrain(logits[0].astype(jnp.float32))


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


@_jit(donate=("state",))
def insert_step(state: DecodeArrays, prefix_k, prefix_v, length, row: smp.SamplerState, slots, count,
                mask, sample_index, first, *, cfg: StepConfig) -> DecodeArrays:
    """Install one prefix into ``slots[:count]`` (insert and bulk_insert).

    ``prefix_k``/``prefix_v`` (layers, kv_heads, T, head_dim) hold ``length`` live
    positions; ``slots`` (R,) lists the target slots first; ``mask`` (R,) marks them,
    ``sample_index`` (R,) gives each its sample and ``first`` (R,) its first token
    (drawn by :func:`first_token_step`), which it feeds next.
    """
    encode = kv_encode if cfg.kv_int8 else (lambda x: x.astype(cfg.cache_dtype))
    new_k, new_v = encode(prefix_k), encode(prefix_v)

    # Positions past the prefix keep stale values: a slot writes each position before
    # any query of its own reads it, so they are never seen.
    def copy(i, kv):
        at = (0, slots[i], 0, 0, 0)
        return (lax.dynamic_update_slice(kv[0], new_k[:, None], at), lax.dynamic_update_slice(kv[1], new_v[:, None], at))

    k, v = lax.fori_loop(0, count, copy, (state.k, state.v))
    sampler = smp.record(smp.install(state.sampler, row, mask, sample_index), first, mask)
    state = DecodeArrays(
        k=k, v=v,
        next_tokens=jnp.where(mask, first, state.next_tokens), prompt_len=jnp.where(mask, length, state.prompt_len),
        completion=jnp.where(mask, 1, state.completion), occupied=state.occupied | mask, sampler=sampler,
    )
    return _constrain_state(cfg, state)


@_jit(donate=("state",))
def generate_step(params, state: DecodeArrays, override_tokens, override_mask, token_mask, *, cfg: StepConfig):
    """One decode step for every occupied slot (its cache not full), overrides first;
    ``token_mask`` (R, W) int32 allowed-token words (all bits set where a slot has none)."""
    sampler = smp.override(state.sampler, override_tokens, override_mask)
    feed = jnp.where(override_mask, override_tokens, state.next_tokens)
    total = state.prompt_len + state.completion
    live = state.occupied & (total < cfg.cache_length)
    positions = jnp.maximum(total - 1, 0)  # the latest token's position; empty rows: 0 (not written)
    logits, k, v = run_model(
        cfg, params, feed[:, None], positions[:, None], state.k, state.v, write_mask=live[:, None],
        int8_cache=cfg.kv_int8)
    res = smp.sample(sampler, logits[:, 0], live, num_top=cfg.num_top, candidates=cfg.candidates, token_mask=token_mask)
    sampler = smp.record(sampler, res.tokens, live)
    completion = state.completion + live.astype(jnp.int32)
    state = replace(state, k=k, v=v, next_tokens=jnp.where(live, res.tokens, feed), completion=completion, sampler=sampler)
    packed = pack(cfg, res, live, jnp.where(state.occupied, completion, 0))
    return _constrain_state(cfg, state), packed


@_jit(donate=("state",))
def free_step(state: DecodeArrays, slot, *, cfg: StepConfig) -> DecodeArrays:
    """Empty one slot (its cache and sampler row are overwritten at the next insert)."""
    return _constrain_state(cfg, replace(state, occupied=state.occupied.at[slot].set(False)))
