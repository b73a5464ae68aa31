"""The static-shape graphs of the neuron backend, as torch modules.

Each graph is a pure function of its inputs, weights included (as NxD compiles them:
one artifact serves every checkpoint of the same config). The model is
:mod:`polyengine.backends.torch_common.model`'s ``forward`` and the sampler is
:mod:`polyengine.backends.torch_common.sampling`'s ``sample`` with ``SamplerFlags()``
(every step on), so one graph serves every request. Nothing here knows about the
engine's host bookkeeping, files or compilers (:mod:`.compile` does those).

Graphs (shapes static per bucket; ``R`` slots, ``V`` vocabulary, ``L`` layers):

``ContextEncoding(config, names, bucket, linear=None, inplace=False, batch=1)``
    ``(weights, tokens (B, P), last (B,))`` -> ``logits (B, V)`` float32 at each row's
    ``last``, ``k, v (L, B, kv_heads, P, head_dim)``: the prompts' K/V (pad positions
    after a prompt hold garbage the engine slices off; causal attention keeps them
    invisible). ``B`` > 1 is a batched prefill of ``B`` prompts of one bucket, each row
    attending only to itself (option ``batched_prefill``).

``ContextContinuation(config, names, prefix_bucket, bucket, linear=None, inplace=False)``
    A prompt continuing a prefix (``existing_prefix``), one graph per (prefix bucket
    ``Q``, prompt bucket ``P``): ``(weights, prefix_k, prefix_v (L, 1, kv_heads, Q,
    head_dim), start (1,), tokens (1, P), last (1,))`` -> ``logits (1, V)`` at ``last``,
    ``k, v (L, 1, kv_heads, Q + P, head_dim)``: the prefix's ``start`` positions, then
    the prompt's at ``start ..`` (positions past ``start + last`` hold garbage the engine
    slices off). The prefix tensors are inputs, copied, never written.

``TokenGeneration(config, names, batch, tokens, kv_len, max_cache_length, num_top, linear=None, inplace=False)``
    One decode step for a batch bucket of ``B`` seq_ids, ``T`` tokens per row:
    ``T = 1`` is token generation, ``T = k`` verifies ``k - 1`` draft tokens in one pass
    (the speculation graph). Inputs ``(weights, k_cache, v_cache, seq_ids (B,),
    occupied (R,), prompt_len (R,), token_mask (R, W) int32, masked (R,) bool,
    [drafts (B, T-1)], sampler state (R rows))``;
    outputs ``(packed (R, width) int32, counts, step, last_token, k_cache, v_cache)``.
    Everything per row is derived on the device from the state: the token fed is the
    slot's ``last_token``, its position ``prompt_len + step - 1``, its room
    ``max_cache_length - prompt_len - step``. So the host never reads a token to
    submit the next step. ``packed`` is the step's result in
    :class:`~polyengine.engine.ResultLayout` ``(k=T, top_n=num_top, logprobs=True)``.

Speculation is exact: the verify pass samples position ``j`` with the slot's own
stream at step ``step + j`` and the penalty counts of the draft tokens before it, and
accepts drafts while they equal what it sampled. The accepted tokens are therefore
the tokens plain decoding draws, for greedy and sampled requests alike (the stream is
counter-based); only how many arrive per step changes.

``inplace`` (every graph): the forward writes K/V with ``index_put_`` into the cache it
is given instead of returning a scattered copy (``StepSpec.inplace``). The ``export``
compiler runs the exported program op by op, where each out-of-place scatter copies the
whole cache once per layer; Inductor and neuronx-cc compile the out-of-place form into
in-place writes themselves, so their graphs keep it.

``linear`` is the forward's projection hook (``StepSpec.linear``): None on one core;
the Neuron path's tensor parallelism passes its sharded projections (:mod:`.nxd`), with
``config`` then holding one core's share of the heads and MLP width.

Allowed-token masks are inputs of every token-generation graph (all bits set and
``masked`` False when a step has none, so nothing recompiles): a masked slot's mask
applies to its first position, and the slot emits exactly that one token (the protocol's
rule for masked slots; its drafts are discarded).

Padding: the rows of a batch bucket are distinct seq_ids; rows that are not live
(empty slots padding the batch, slots whose cache is full) write K/V only into their
own rows, at positions no live row reads, and record nothing in the sampler.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from polyengine.engine import ResultLayout
from polyengine.models import ModelConfig

from polyengine.backends.torch_common.model import StepSpec, TorchWeights, forward
from polyengine.backends.torch_common.sampling import SamplerFlags, SamplerState, sample
from polyengine.backends.torch_common.transfer import pack_results

__all__ = ["ContextEncoding", "ContextContinuation", "TokenGeneration", "PagedContextEncoding",
           "PagedContextContinuation", "PagedTokenGeneration", "SAMPLER_FIELDS", "result_layout"]

SAMPLER_FIELDS = tuple(f.name for f in fields(SamplerState))
# Every sampling step compiled in: one graph serves any mix of requests.
_ALL_STEPS = SamplerFlags()


def result_layout(tokens: int, num_top: int) -> ResultLayout:
    return ResultLayout(k=tokens, top_n=num_top, logprobs=True)


def _weights(config: ModelConfig, names: tuple[str, ...], tensors) -> TorchWeights:
    return TorchWeights(config, dict(zip(names, tensors)))


class ContextEncoding(torch.nn.Module):
    """A prompt padded to one prefill bucket; see the module docstring."""

    aliases: tuple[tuple[int, int], ...] = ()  # (input index, output index) updated in place

    def __init__(self, config: ModelConfig, names: tuple[str, ...], bucket: int, linear=None, inplace: bool = False,
                 batch: int = 1):
        super().__init__()
        self.config, self.names, self.bucket, self.batch = config, names, bucket, batch
        self.spec = StepSpec(linear=linear, inplace=inplace)

    def forward(self, weights, tokens, last):
        c = self.config
        w = _weights(c, self.names, weights)
        shape = (c.num_hidden_layers, self.batch, c.num_key_value_heads, self.bucket, c.head_dim)
        k = torch.zeros(shape, dtype=w.dtype, device=tokens.device)
        v = torch.zeros(shape, dtype=w.dtype, device=tokens.device)
        positions = torch.arange(self.bucket, device=tokens.device)[None].expand(self.batch, -1)  # (B, P)
        logits, k, v = forward(w, self.spec, tokens, positions, k, v, rows=None, logits_at=last)
        return logits.float(), k, v


class ContextContinuation(torch.nn.Module):
    """A prompt continuing a prefix, for one (prefix bucket, prompt bucket) pair; see the
    module docstring."""

    aliases: tuple[tuple[int, int], ...] = ()

    def __init__(self, config: ModelConfig, names: tuple[str, ...], prefix_bucket: int, bucket: int, linear=None,
                 inplace: bool = False):
        super().__init__()
        self.config, self.names, self.prefix_bucket, self.bucket = config, names, prefix_bucket, bucket
        self.spec = StepSpec(linear=linear, inplace=inplace)

    def forward(self, weights, prefix_k, prefix_v, start, tokens, last):
        w = _weights(self.config, self.names, weights)
        pad = prefix_k.new_zeros(prefix_k.shape[:3] + (self.bucket,) + prefix_k.shape[4:])
        k, v = torch.cat([prefix_k, pad], dim=3), torch.cat([prefix_v, pad], dim=3)
        positions = start[:, None] + torch.arange(self.bucket, device=tokens.device)[None]  # (1, P)
        # Pad tokens (after last) write past the prompt, where no live query reads and the
        # engine slices off (as in ContextEncoding): no write mask, whose anchor would be a
        # data-dependent index the export cannot capture.
        logits, k, v = forward(w, self.spec, tokens, positions, k, v, rows=None, logits_at=last)
        return logits.float(), k, v


def _expanded(state: SamplerState, seq_ids: torch.Tensor, fed: torch.Tensor) -> SamplerState:
    """A ``(B*T)``-row state: row ``(b, j)`` is slot ``seq_ids[b]`` as if the tokens fed
    after the first (``fed[b, 1..j]``, the drafts) had been accepted: counts include
    them and the step is ``step + j``. Row ``(b, 0)`` is the slot as it is."""
    b, t = fed.shape
    v = state.vocab_size

    def rows(x: torch.Tensor) -> torch.Tensor:
        return x[seq_ids].repeat_interleave(t, dim=0)

    out = {name: rows(getattr(state, name)) for name in SAMPLER_FIELDS if name not in ("counts", "step", "eos_mask")}
    counts = state.counts[seq_ids]  # (B, V)
    if t > 1:
        ids = torch.arange(v, device=fed.device)
        seen = (fed[:, 1:, None] == ids).to(torch.int32).cumsum(dim=1)  # (B, T-1, V)
        counts = torch.cat([counts[:, None], counts[:, None] + seen], dim=1)  # (B, T, V)
    out["counts"] = counts.reshape(b * t, v)
    out["step"] = (state.step[seq_ids][:, None] + torch.arange(t, device=fed.device)).reshape(-1)
    out["eos_mask"] = state.eos_mask
    return SamplerState(**out)


class TokenGeneration(torch.nn.Module):
    """One decode step (``tokens == 1``) or a speculation verify pass (``tokens == k``)
    for one batch x sequence bucket; see the module docstring."""

    # k_cache and v_cache (inputs 1, 2) come back as outputs 4, 5: the compiler updates
    # them in place (the KV cache lives in the decode state, as NxD's aliased buffers).
    aliases = ((1, 4), (2, 5))

    def __init__(self, config: ModelConfig, names: tuple[str, ...], *, batch: int, tokens: int, kv_len: int,
                 max_cache_length: int, num_top: int, linear=None, inplace: bool = False):
        super().__init__()
        self.config, self.names = config, names
        self.batch, self.tokens, self.kv_len = batch, tokens, kv_len
        self.spec = StepSpec(kv_len=kv_len, linear=linear, inplace=inplace)
        self.max_cache_length, self.num_top = max_cache_length, num_top

    def forward(self, weights, k_cache, v_cache, seq_ids, occupied, prompt_len, token_mask, masked, *rest):
        return self._step(weights, k_cache, v_cache, None, seq_ids, occupied, prompt_len, token_mask, masked, *rest)

    def _step(self, weights, k_cache, v_cache, block_table, seq_ids, occupied, prompt_len, token_mask, masked, *rest):
        drafts, sampler = (rest[0], rest[1]) if self.tokens > 1 else (None, rest[0])
        st = SamplerState(**sampler)
        w = _weights(self.config, self.names, weights)
        t, dev = self.tokens, seq_ids.device
        step = st.step[seq_ids]  # (B,)
        total = prompt_len[seq_ids] + step  # prompt + completion, the latest token included
        room = self.max_cache_length - total  # tokens this slot may still add
        live = occupied[seq_ids] & (room > 0)
        fed = st.last_token[seq_ids][:, None]  # (B, 1): the latest token, not yet in the cache
        if drafts is not None:
            fed = torch.cat([fed, drafts], dim=1)  # (B, T)
        if block_table is None:
            # Rows that are not live may sit at any position; clamped, they stay inside their own row.
            positions = ((total - 1)[:, None] + torch.arange(t, device=dev)).clamp(0, k_cache.shape[3] - 1)
            logits, k_cache, v_cache = forward(w, self.spec, fed, positions, k_cache, v_cache, rows=seq_ids)
        else:
            # Block layout: a row reads and writes through its block-table row. A row that is
            # not live writes nothing (its table row may name pages other holders own now);
            # clamped, its position stays inside its table row.
            width = block_table.shape[1] * k_cache.shape[3]
            positions = ((total - 1)[:, None] + torch.arange(t, device=dev)).clamp(0, width - 1)
            logits, k_cache, v_cache = forward(w, self.spec, fed, positions, k_cache, v_cache,
                                               write_mask=live[:, None].expand(-1, t), page_table=block_table[seq_ids])
        words = token_mask[seq_ids]  # (B, W): the mask applies to each slot's first position only
        if t > 1:
            first = (torch.arange(t, device=dev) == 0)[None, :, None]
            words = torch.where(first, words[:, None, :], torch.full_like(words[:, None, :], -1)).reshape(-1, words.shape[-1])
        res = sample(_expanded(st, seq_ids, fed), logits.reshape(-1, logits.shape[-1]), None, _ALL_STEPS, self.num_top,
                     words)
        drawn = res.tokens.reshape(-1, t)  # (B, T)
        accepted = torch.ones_like(step)
        if drafts is not None:  # leading drafts equal to what the target drew; a masked slot takes one token
            accepted = accepted + torch.cumprod((drawn[:, :-1] == drafts).to(torch.int64), dim=1).sum(dim=1)
            accepted = torch.where(masked[seq_ids], torch.ones_like(accepted), accepted)
        emit = torch.where(live, torch.minimum(accepted, room), torch.zeros_like(room))  # (B,)
        valid = torch.arange(t, device=dev)[None, :] < emit[:, None]  # (B, T)

        flat_rows = seq_ids.repeat_interleave(t)
        counts = st.counts.index_put((flat_rows, drawn.reshape(-1)), valid.reshape(-1).to(torch.int32), accumulate=True)
        new_step = st.step.index_put((seq_ids,), step + emit)
        latest = drawn.gather(1, (emit - 1).clamp(min=0)[:, None])[:, 0]
        last_token = st.last_token.index_put((seq_ids,), torch.where(emit > 0, latest, st.last_token[seq_ids]))

        n = self.num_top
        block = pack_results(  # (B, width); lengths filled for every slot below
            result_layout(t, n), tokens=torch.where(valid, drawn, torch.zeros_like(drawn)), valid=valid,
            lengths=torch.zeros_like(emit), logprobs=res.logprobs, top_ids=res.top_ids,
            top_logprobs=res.top_logprobs)
        packed = torch.zeros((occupied.shape[0], block.shape[1]), dtype=torch.int32, device=dev).index_put((seq_ids,), block)
        lengths = torch.where(occupied, new_step, torch.zeros_like(new_step)).to(torch.int32)[:, None]
        packed = torch.cat([packed[:, : 2 * t], lengths, packed[:, 2 * t + 1:]], dim=1)  # (R, width)
        return packed, counts, new_step, last_token, k_cache, v_cache


# -- the block KV layout (option page_size) ------------------------------------------------


def write_slots(pool: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor, last: torch.Tensor,
                inplace: bool) -> torch.Tensor:
    """Write ``B`` prompts' K or V ``new`` (L, B, kv_heads, P, head_dim) into a block pool
    (L, blocks, kv_heads, block_size, head_dim) through ``slot_mapping`` (B * P,): row
    ``b``'s position ``i`` goes to block ``slot // block_size``, offset ``slot %
    block_size`` of entry ``b * P + i``. Pad positions (after the row's ``last``) carry
    its last prompt position's slot and take its value, so the duplicates write the same
    bits (a scatter's duplicates have no defined order); rows never share a slot."""
    layers, _, heads, size, _ = pool.shape
    dev = pool.device
    rows, p = new.shape[1], new.shape[3]
    src = torch.minimum(torch.arange(p, device=dev)[None], last[:, None])  # (B, P)
    flat = (torch.arange(rows, device=dev)[:, None] * p + src).reshape(-1)  # (B * P,) into B * P positions
    values = new.permute(0, 1, 3, 2, 4).reshape(layers, rows * p, heads, -1).index_select(1, flat).to(pool.dtype)
    idx = (torch.arange(layers, device=dev)[:, None, None], (slot_mapping // size)[None, :, None],
           torch.arange(heads, device=dev)[None, None, :], (slot_mapping % size)[None, :, None])
    if inplace:
        return pool.index_put_(idx, values)
    return pool.index_put(idx, values)


def read_blocks(pool: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """``blocks`` (W,) of a pool as one contiguous row (L, 1, kv_heads, length, head_dim),
    ``length <= W * block_size``."""
    layers, _, heads, size, dim = pool.shape
    rows = pool.index_select(1, blocks)  # (L, W, kv_heads, block_size, head_dim)
    return rows.transpose(1, 2).reshape(layers, heads, -1, dim)[:, None, :, :length]


class PagedContextEncoding(ContextEncoding):
    """Context encoding into the block pools: ``(weights, k_pool, v_pool, tokens (B, P),
    last (B,), slot_mapping (B * P,))`` -> ``logits (B, V)``; the pools updated in place
    (NxD's context encoding writing the block KV cache through its slot mapping)."""

    aliases = ((1, 1), (2, 2))

    def __init__(self, config: ModelConfig, names: tuple[str, ...], bucket: int, linear=None, inplace: bool = False,
                 batch: int = 1):
        super().__init__(config, names, bucket, linear=linear, inplace=inplace, batch=batch)
        self.inplace = inplace

    def forward(self, weights, k_pool, v_pool, tokens, last, slot_mapping):
        logits, k, v = super().forward(weights, tokens, last)
        return (logits, write_slots(k_pool, k, slot_mapping, last, self.inplace),
                write_slots(v_pool, v, slot_mapping, last, self.inplace))


class PagedContextContinuation(ContextContinuation):
    """A prompt continuing a prefix held in blocks: ``(weights, k_pool, v_pool,
    prefix_blocks (ceil(Q / block_size),), start (1,), tokens (1, P), last (1,),
    slot_mapping (P,))`` -> ``logits (1, V)``. The prefix's K/V are read through its block
    table; the prompt's new positions are written through the slot mapping (the engine
    has made every block they touch the new prefix's own first: copy on write)."""

    aliases = ((1, 1), (2, 2))

    def __init__(self, config: ModelConfig, names: tuple[str, ...], prefix_bucket: int, bucket: int, linear=None,
                 inplace: bool = False):
        super().__init__(config, names, prefix_bucket, bucket, linear=linear, inplace=inplace)
        self.inplace = inplace

    def forward(self, weights, k_pool, v_pool, prefix_blocks, start, tokens, last, slot_mapping):
        q = self.prefix_bucket
        # Positions start..Q of the read blocks hold whatever those blocks hold (the
        # contiguous graph's input has zeros there): the prompt's own writes cover them or
        # they lie past every query, where attention weighs them exactly 0.
        head_k, head_v = read_blocks(k_pool, prefix_blocks, q), read_blocks(v_pool, prefix_blocks, q)
        logits, k, v = super().forward(weights, head_k, head_v, start, tokens, last)
        new = start + torch.arange(self.bucket, device=tokens.device)  # (P,): the prompt's positions
        k, v = k.index_select(3, new), v.index_select(3, new)
        return (logits, write_slots(k_pool, k, slot_mapping, last, self.inplace),
                write_slots(v_pool, v, slot_mapping, last, self.inplace))


class PagedTokenGeneration(TokenGeneration):
    """:class:`TokenGeneration` over the block pools: ``(weights, k_pool, v_pool,
    block_table (R, W), seq_ids, ...)``, the rest as there. Row ``b`` reads its first
    ``kv_len`` positions through ``block_table[seq_ids[b]]`` (``W = ceil(kv_len /
    block_size)``: the table's static width per sequence bucket) and writes its new K/V at
    ``(table[p // block_size], p % block_size)``; rows that are not live write nothing."""

    def forward(self, weights, k_pool, v_pool, block_table, seq_ids, occupied, prompt_len, token_mask, masked, *rest):
        return self._step(weights, k_pool, v_pool, block_table, seq_ids, occupied, prompt_len, token_mask, masked, *rest)
