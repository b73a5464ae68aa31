"""The reference engine: the whole protocol over the NumPy forward and the core sampler.

Every other backend is compared with this one, so it takes the plainest route: the
KV cache is one host array per slot, the decode state is mutated in place (and
returned, as the protocol asks), and every check runs before any state changes, so a
refused call leaves nothing half done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from polyengine.engine import Capabilities, EngineBase, EngineConfig, Prefix, ResultTokens, SlotTable
from polyengine.models import Model
from polyengine.models.blocks import FORMATS
from polyengine.models.config import ARCHITECTURES
from polyengine.prefix import PortablePrefix
from polyengine.sampling import RowState, SamplingParams, sample
from polyengine.sampling.params import ENGINE_FIELDS

from polyengine.backends.reference.model import ReferenceParams, forward, hidden_states

__all__ = ["ReferenceEngine", "ReferenceDecodeState", "create_engine"]

_DTYPES = {"float64": np.float64, "float32": np.float32}


@dataclass
class ReferenceDecodeState:
    num_slots: int
    k: list[np.ndarray]  # per slot (layers, kv_heads, max_cache_length, head_dim)
    v: list[np.ndarray]
    slots: SlotTable  # the kit's host record: prompt and completion counts, last result
    rows: list[RowState | None] = field(default_factory=list)  # sampler state: params, prompt, completion so far
    next_token: list[int] = field(default_factory=list)  # what each slot's next generate step feeds

    def occupied(self) -> list[int]:
        return self.slots.occupied()

    def is_occupied(self, slot: int) -> bool:
        return self.slots.is_occupied(slot)


class ReferenceEngine(EngineBase):
    name = "reference"

    def __init__(self, model: Model, config: EngineConfig):
        super().__init__(model, config, Capabilities(
            dtypes=tuple(_DTYPES),
            sampling_params=ENGINE_FIELDS,
            max_top_logprobs=20,
            bulk_insert=True,
            portable_prefix=True,
            prefix_reuse=True,
            architectures=ARCHITECTURES, token_masks=True,
            weight_formats=tuple(FORMATS),  # every block format, dequantized exactly (float64) at load
            embeddings=True,
        ), device="cpu (NumPy)")
        self.np_dtype = np.dtype(_DTYPES[self.dtype])
        mc = model.config
        # Refuse before allocating: the engine converts the weights into its dtype (the
        # Model's records stay as stored) and preallocates every slot's cache.
        self.check_memory({
            f"a {self.dtype} copy of the weights": mc.num_parameters() * self.np_dtype.itemsize,
            f"the KV caches of {config.max_slots} slots x {config.max_cache_length} positions":
                config.max_slots * config.max_cache_length * mc.kv_bytes_per_token(self.np_dtype.itemsize),
        })
        self._params: ReferenceParams | None = None

    # -- lifecycle -----------------------------------------------------------------------

    def load_params(self) -> ReferenceParams:
        if self._params is None:
            self._params = ReferenceParams.from_model(self.model, self.np_dtype, context=self.max_cache_length,
                                                      formats=self.capabilities.weight_formats)
        return self._params

    def init_decode_state(self) -> ReferenceDecodeState:
        shape = self._cache_shape(self.max_cache_length)
        n = self.max_concurrent_decodes
        return ReferenceDecodeState(
            num_slots=n,
            k=[np.zeros(shape, self.np_dtype) for _ in range(n)],
            v=[np.zeros(shape, self.np_dtype) for _ in range(n)],
            slots=SlotTable(n), rows=[None] * n, next_token=[0] * n,
        )

    def _cache_shape(self, length: int) -> tuple[int, int, int, int]:
        c = self.model.config
        return (c.num_hidden_layers, c.num_key_value_heads, length, c.head_dim)

    # -- prefill -------------------------------------------------------------------------

    def prefill(
        self,
        *,
        params: ReferenceParams,
        tokens: Sequence[int] | np.ndarray,
        sampling: SamplingParams,
        existing_prefix: Prefix | None = None,
        token_mask: np.ndarray | None = None,
    ) -> tuple[Prefix, ResultTokens]:
        toks, sampling, start = self.check_prefill(tokens, sampling, existing_prefix)
        mask = self.check_token_mask(token_mask, sampling)
        total = start + toks.size
        # Pad to the bucket (when configured) the way a static-shape backend would:
        # pad tokens sit after the true ones, so causality keeps them out of every
        # true position, and their cache entries are dropped below.
        padded = (total if self.config.prefill_buckets is None else self.config.bucket_for(total)) - start
        shape = self._cache_shape(start + padded)
        k, v = np.zeros(shape, self.np_dtype), np.zeros(shape, self.np_dtype)
        if existing_prefix is not None:
            k[:, :, :start] = existing_prefix.kv[0]
            v[:, :, :start] = existing_prefix.kv[1]
        batch = np.zeros((1, padded), np.int64)
        batch[0, : toks.size] = toks
        logits = self._forward(params, batch, np.array([start]), [k], [v])[0, toks.size - 1]
        prompt = toks if existing_prefix is None else np.concatenate([existing_prefix.prompt_tokens, toks])
        prefix = Prefix(
            kv=(k[:, :, :total].copy(), v[:, :, :total].copy()),
            logits=logits,
            prompt_tokens=prompt.astype(np.int32),
            sampling=sampling,
            backend=self.name,
            first_token=-1,
            model_id=self.model_id,
            token_mask=mask,
            nbytes=self.kv_bytes(total),
        )
        out = self._sample([logits], [RowState(sampling, 0, 0, prefix.prompt_tokens, np.zeros(0, np.int32), mask)])
        prefix.first_token = int(out.tokens[0])
        return prefix, self._result(out)

    # -- insert (the kit's flow: checks, then _install, then the slot table) ---------------

    def _install(self, prefix: Prefix, state: ReferenceDecodeState, slots: list[int], *, draw: bool):
        out = None
        if draw:
            empty = np.zeros(0, np.int32)
            rows = [RowState(prefix.sampling, i, 0, prefix.prompt_tokens, empty, prefix.token_mask)
                    for i in range(len(slots))]
            out = self._sample([prefix.logits] * len(slots), rows)
        n = prefix.true_length
        for i, slot in enumerate(slots):
            first = int(out.tokens[i]) if draw else prefix.first_token
            state.k[slot][:, :, :n] = prefix.kv[0]
            state.v[slot][:, :, :n] = prefix.kv[1]
            state.rows[slot] = RowState(prefix.sampling, i, 1, prefix.prompt_tokens, np.array([first], np.int32))
            state.next_token[slot] = first
        return self._result(out) if draw else None

    def _release(self, state: ReferenceDecodeState, slot: int) -> None:
        state.rows[slot] = None

    # -- generate --------------------------------------------------------------------------

    def generate(
        self, params: ReferenceParams, decode_state: ReferenceDecodeState, *, overrides: Mapping[int, int] | None = None,
        token_masks: Mapping[int, np.ndarray] | None = None,
    ) -> tuple[ReferenceDecodeState, ResultTokens]:
        state = decode_state
        forced = self.check_overrides(overrides, state.slots.last_result)
        masks = self.check_token_masks(token_masks, state.slots.last_result, forced=forced,
                                       sampling_of=state.slots.sampling)
        for slot, (tok, position) in forced.items():
            self._force(state, slot, tok, position)

        n = state.num_slots
        live = self._live(state)
        tokens = np.zeros((n, 1), np.int32)
        valid = np.zeros((n, 1), bool)
        top_n = max([state.rows[i].params.top_logprobs for i in live], default=0)
        logprobs = np.zeros((n, 1), np.float32)
        top_ids = np.full((n, 1, top_n), -1, np.int32)
        top_lp = np.full((n, 1, top_n), -np.inf, np.float32)
        if live:
            batch = np.array([[state.next_token[i]] for i in live], np.int64)
            starts = np.array([state.slots[i].length for i in live])
            logits = self._forward(params, batch, starts, [state.k[i] for i in live], [state.v[i] for i in live])[:, 0]
            rows = []
            for i in live:
                row = state.rows[i]
                row.step = len(row.completion_tokens)
                row.token_mask = masks.words[i] if masks is not None and masks.masked[i] else None
                rows.append(row)
            out = self._sample(list(logits), rows)
            for j, i in enumerate(live):
                row, tok = state.rows[i], int(out.tokens[j])
                state.next_token[i] = tok
                row.completion_tokens = np.append(row.completion_tokens, tok).astype(np.int32)
                tokens[i, 0], valid[i, 0] = tok, True
                logprobs[i, 0] = out.logprobs[j]
                k = out.top_ids.shape[1]
                top_ids[i, 0, :k] = out.top_ids[j]
                top_lp[i, 0, :k] = out.top_logprobs[j]
            state.slots.advance(live)
        lengths = np.array(state.slots.lengths(), np.int32)
        return state, ResultTokens(
            tokens=tokens, valid=valid, lengths=lengths, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_lp
        )

    def _live(self, state: ReferenceDecodeState) -> list[int]:
        """Occupied slots with room for another token (prompt plus completion below max_cache_length)."""
        return state.slots.live(self.max_cache_length)

    @staticmethod
    def _force(state: ReferenceDecodeState, slot: int, token: int, position: int) -> None:
        """Make ``token`` completion token ``position``, dropping what followed it: the
        cache then holds the prompt and the completion tokens fed before it."""
        row = state.rows[slot]
        row.completion_tokens = np.append(row.completion_tokens[:position], token).astype(np.int32)
        state.slots.force(slot, position)
        state.next_token[slot] = token

    # -- portable prefixes -----------------------------------------------------------------

    def export_prefix(self, prefix: Prefix) -> PortablePrefix:
        self.check_prefix(prefix)
        return PortablePrefix(
            k=prefix.kv[0], v=prefix.kv[1], prompt_tokens=prefix.prompt_tokens,
            last_logits=prefix.logits, sampling=prefix.sampling,
            model_fingerprint=self.model.fingerprint,
        )

    def import_prefix(self, portable: PortablePrefix) -> Prefix:
        prompt, sampling = self.check_portable(portable)
        logits = portable.last_logits.astype(self.np_dtype)
        row = RowState(sampling, 0, 0, prompt, np.zeros(0, np.int32))
        first = int(self._sample([logits], [row]).tokens[0])
        return Prefix(
            kv=(portable.k.astype(self.np_dtype), portable.v.astype(self.np_dtype)), logits=logits,
            prompt_tokens=prompt, sampling=sampling, backend=self.name, first_token=first,
            model_id=self.model_id, nbytes=self.kv_bytes(prompt.size),
        )

    # -- embeddings ------------------------------------------------------------------------

    def embed(self, *, params: ReferenceParams, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        toks = self.check_embed(tokens)
        shape = self._cache_shape(toks.size)  # a scratch cache: no slot or prefix is touched
        k, v = np.zeros(shape, self.np_dtype), np.zeros(shape, self.np_dtype)
        return hidden_states(params, toks[None].astype(np.int64), np.array([0]), [k], [v])[0]

    # -- helpers ---------------------------------------------------------------------------

    def _forward(self, params: ReferenceParams, tokens, starts, k_caches, v_caches) -> np.ndarray:
        """The model's forward (one seam, so test variants can change its precision)."""
        return forward(params, tokens, starts, k_caches, v_caches)

    def _sample(self, logits: list[np.ndarray], rows: list[RowState]):
        return sample(np.stack(logits), rows, self.eos_token_ids)

    @staticmethod
    def _result(out) -> ResultTokens:
        return ResultTokens.first_tokens(out.tokens.astype(np.int32), out.logprobs.astype(np.float32),
                                         out.top_ids.astype(np.int32), out.top_logprobs.astype(np.float32))


def create_engine(*, model: Model, config: EngineConfig) -> ReferenceEngine:
    return ReferenceEngine(model, config)


def diagnose() -> dict[str, str]:
    """What ``polyengine backends --verbose`` says of this backend: one path, no fallback."""
    return {"device": "cpu", "compute": f"NumPy {np.__version__}, float64 by default: the oracle (exact, slow)"}
