"""A third-party backend written only against the kit: ``EngineBase``, the protocol
types, the core sampler and ``docs/backends.md``; it imports nothing of the reference
backend. tests/test_conformance_thirdparty.py installs it as a throwaway package and
runs the whole conformance suite on it.

A float32 NumPy engine with its own forward (a KV cache array per slot, attention over
each slot's own positions), the core sampler on the host, and none of the optional
features (no bulk insert, no portable prefixes, no prefix reuse): every refusal comes
from the kit. ``LaxEngine`` skips one refusal (it accepts options it does not know) and
must fail the suite with a message naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from polyengine.engine import Capabilities, EngineBase, EngineConfig, Prefix, ResultTokens
from polyengine.models import Model
from polyengine.sampling import RowState, sample

__all__ = ["ThirdPartyEngine", "LaxEngine", "create_engine", "create_lax_engine"]


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, inv_freq):  # x (T, heads, d), pos (T,)
    ang = pos[:, None].astype(np.float64) * inv_freq[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :].astype(x.dtype)
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


@dataclass
class _Slot:
    row: RowState
    length: int  # cache positions filled
    next_token: int
    last: int = 1


@dataclass
class State:
    num_slots: int
    k: np.ndarray  # (slots, layers, kv_heads, cache, head_dim)
    v: np.ndarray
    slots: list = field(default_factory=list)


class ThirdPartyEngine(EngineBase):
    name = "thirdparty"

    def __init__(self, model: Model, config: EngineConfig):
        super().__init__(model, config, Capabilities(dtypes=("float32",)), device="cpu (NumPy, float32)")
        c = model.config
        self.check_memory({"KV caches": config.max_slots * config.max_cache_length * c.kv_bytes_per_token(4),
                           "float32 weights": c.num_parameters() * 4})
        self.w = {k: np.asarray(v, np.float32) for k, v in model.weights.items()}
        self.head = self.w["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"]
        self.inv_freq = c.rope_inv_freq()

    def load_params(self):
        return self.w

    def init_decode_state(self) -> State:
        c, n = self.model.config, self.max_concurrent_decodes
        shape = (n, c.num_hidden_layers, c.num_key_value_heads, self.max_cache_length, c.head_dim)
        return State(n, np.zeros(shape, np.float32), np.zeros(shape, np.float32), [None] * n)

    def _forward(self, tokens, start, k, v):
        """Append ``tokens`` at ``start`` to one slot's cache ``k, v`` (layers, kvh, S, d); logits (T, vocab)."""
        c, w = self.model.config, self.w
        t = len(tokens)
        pos = np.arange(start, start + t)
        x = w["model.embed_tokens.weight"][np.asarray(tokens)]
        nh, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim

        def lin(h, name):
            y = h @ w[name + ".weight"].T
            return y + w[name + ".bias"] if name + ".bias" in w else y

        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = _rms(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
            q = _rope(lin(h, p + "self_attn.q_proj").reshape(t, nh, d), pos, self.inv_freq)
            kk = _rope(lin(h, p + "self_attn.k_proj").reshape(t, nkv, d), pos, self.inv_freq)
            k[i, :, start:start + t] = kk.transpose(1, 0, 2)
            v[i, :, start:start + t] = lin(h, p + "self_attn.v_proj").reshape(t, nkv, d).transpose(1, 0, 2)
            keys = np.repeat(k[i, :, : start + t], nh // nkv, axis=0)
            vals = np.repeat(v[i, :, : start + t], nh // nkv, axis=0)
            s = q.transpose(1, 0, 2) @ keys.transpose(0, 2, 1) / np.sqrt(d)  # (nh, T, S)
            s = np.where(np.arange(start + t)[None, None, :] > pos[None, :, None], -np.inf, s)
            s = np.exp(s - s.max(-1, keepdims=True))
            a = (s / s.sum(-1, keepdims=True)) @ vals  # (nh, T, d)
            x = x + lin(a.transpose(1, 0, 2).reshape(t, nh * d), p + "self_attn.o_proj")
            h = _rms(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            g = lin(h, p + "mlp.gate_proj")
            x = x + lin(g / (1 + np.exp(-g)) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
        return _rms(x, w["model.norm.weight"], c.rms_norm_eps) @ self.head.T

    def prefill(self, *, params, tokens, sampling, existing_prefix=None):
        toks, sampling, _ = self.check_prefill(tokens, sampling, existing_prefix)
        c = self.model.config
        shape = (c.num_hidden_layers, c.num_key_value_heads, toks.size, c.head_dim)
        k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        logits = self._forward(toks, 0, k, v)[-1]
        out = sample(logits[None], [RowState(sampling, 0, 0, toks, [])], self.eos_token_ids)
        first = int(out.tokens[0])
        prefix = Prefix(kv=(k, v), logits=logits, prompt_tokens=toks, sampling=sampling, backend=self.name,
                        first_token=first, model_id=self.model_id)
        return prefix, self._rows(out, [1])

    def insert(self, prefix, decode_state, slot):
        self.check_prefix(prefix)
        slot = self.check_empty_slot(slot, lambda i: decode_state.slots[i] is not None)
        n = prefix.true_length
        decode_state.k[slot, :, :, :n], decode_state.v[slot, :, :, :n] = prefix.kv
        row = RowState(prefix.sampling, 0, 1, prefix.prompt_tokens, [prefix.first_token])
        decode_state.slots[slot] = _Slot(row, n, prefix.first_token)
        return decode_state

    def generate(self, params, decode_state, *, overrides=None):
        st = decode_state
        forced = self.check_overrides(
            overrides, lambda i: None if st.slots[i] is None else (st.slots[i].row.completion_tokens.size, st.slots[i].last))
        for slot, (tok, pos) in forced.items():
            s = st.slots[slot]
            s.row.completion_tokens = np.append(s.row.completion_tokens[:pos], tok)
            s.length, s.next_token = s.row.prompt_tokens.size + pos, tok
        n = st.num_slots
        live = [i for i, s in enumerate(st.slots)
                if s is not None and s.row.prompt_tokens.size + s.row.completion_tokens.size < self.max_cache_length]
        logits = [self._forward([st.slots[i].next_token], st.slots[i].length, st.k[i], st.v[i])[0] for i in live]
        rows = []
        for i in live:
            s = st.slots[i]
            s.row.step = s.row.completion_tokens.size
            rows.append(s.row)
        tokens, valid = np.zeros((n, 1), np.int32), np.zeros((n, 1), bool)
        lengths = np.array([0 if s is None else s.row.completion_tokens.size for s in st.slots], np.int32)
        top_n = max((r.params.top_logprobs for r in rows), default=0)
        lp, top_ids, top_lp = np.zeros((n, 1), np.float32), np.full((n, 1, top_n), -1, np.int32), np.full((n, 1, top_n), -np.inf, np.float32)
        if live:
            out = sample(np.stack(logits), rows, self.eos_token_ids)
            for j, i in enumerate(live):
                s, tok = st.slots[i], int(out.tokens[j])
                s.length, s.next_token, s.last = s.length + 1, tok, 1
                s.row.completion_tokens = np.append(s.row.completion_tokens, tok)
                tokens[i, 0], valid[i, 0], lengths[i], lp[i, 0] = tok, True, s.row.completion_tokens.size, out.logprobs[j]
                top_ids[i, 0, : out.top_ids.shape[1]] = out.top_ids[j]
                top_lp[i, 0, : out.top_ids.shape[1]] = out.top_logprobs[j]
        return st, ResultTokens(tokens=tokens, valid=valid, lengths=lengths, logprobs=lp, top_ids=top_ids, top_logprobs=top_lp)

    def free_resource(self, decode_state, slot):
        decode_state.slots[self.check_slot(slot)] = None
        return decode_state

    @staticmethod
    def _rows(out, lengths):
        n = out.tokens.shape[0]
        return ResultTokens(tokens=out.tokens.reshape(n, 1), valid=np.ones((n, 1), bool), lengths=np.asarray(lengths, np.int32),
                            logprobs=out.logprobs.reshape(n, 1), top_ids=out.top_ids.reshape(n, 1, -1),
                            top_logprobs=out.top_logprobs.reshape(n, 1, -1))


class LaxEngine(ThirdPartyEngine):
    """Skips one refusal: it drops options it does not know instead of refusing them."""

    name = "thirdparty_lax"

    def __init__(self, model: Model, config: EngineConfig):
        super().__init__(model, config.model_copy(update={"options": {}}))


def create_engine(*, model: Model, config: EngineConfig) -> ThirdPartyEngine:
    return ThirdPartyEngine(model, config)


def create_lax_engine(*, model: Model, config: EngineConfig) -> LaxEngine:
    return LaxEngine(model, config)
