"""The Neuron device path: every graph of an engine as one NxD model on ``tp_degree`` NeuronCores.

On a Neuron instance the graphs of :mod:`.graphs` are not compiled one by one: they
are the models of one neuronx-distributed ``ModelBuilder`` (NxD's model for
inference, the one NxD Inference builds), one key per graph and bucket, traced and
compiled together into one artifact, because only the models of one builder share
weights and state on the device:

- **Weights** are module parameters: never graph inputs (an input crosses from the
  host on every call) and never inlined into the NEFFs (ModelBuilder keeps them apart).
  The artifact therefore holds no checkpoint: one artifact serves every checkpoint of
  the same architecture, and ``nxd_model.initialize(weights)`` moves an engine's
  weights to the NeuronCores once, when the engine loads.
- **The KV cache** is two state parameters (``k_cache``, ``v_cache``) every model that
  touches it declares under the same names, zeroed on the device by NxD's state
  initializer and aliased to the output that holds its new value
  (``input_output_aliases``), so neuronx-cc updates it in place and it never crosses
  to the host. A prefill's K/V reach it through an insert model per prefill bucket,
  since the protocol puts the prefix between prefill and insert. A prompt continuing a
  prefix (option ``prefix_reuse``) runs a continuation model per (prefix bucket, prompt
  bucket) pair, the prefix's K/V an input as the CPU compile path's graph takes them
  (prefixes live on the host, between prefill and insert). With option ``page_size``
  the state is the two block pools instead: the context and continuation models write a
  prompt's K/V into them through its slot mapping, decode reads them through block
  tables, a copy model makes the copies on write, and no insert is needed (a slot shares
  its prefix's blocks).
- **Compiler arguments** per dtype (:data:`COMPILER_ARGS`): ``--auto-cast=none``
  always, since neuronx-cc otherwise casts float32 matmuls to bfloat16 (a declared
  float32 would not be float32) and bfloat16 graphs are bfloat16 as written; bfloat16
  adds ``--enable-mixed-precision-accumulation`` (float32 sums, as NxD builds bf16
  models); ``--model-type=transformer -O2`` as NxD compiles decoders.
- **Tensor parallelism** over ``tp_degree`` cores, split as NxD's parallel layers
  split a decoder (Megatron's column/row scheme): q/k/v and gate/up by output rows
  (whole heads and MLP units per core), o and down by input columns and then summed
  over the tensor-parallel process group with NxD's
  ``reduce_from_tensor_model_parallel_region``; embeddings, norms and the LM head whole
  on every core (so every core samples the same tokens from the same logits). Each
  core's graphs are built for its share of the config (:func:`local_config`) and hold
  its rows of the KV cache; prefill gathers the heads back
  (``gather_from_tensor_model_parallel_region``) so a prefix is whole, and the insert
  and continuation models take each core's heads of a whole prefix (``tp_rank``, a
  one-element weight whose value is the core's rank). :func:`shards` splits the
  checkpoint, one dict per core, which is what ``initialize`` takes.

Two rules of NxD's runtime shape the models: it routes a call to a model by the shapes
of its inputs, so decode models of one batch and another attended length get a bucket
marker input (as NxD Inference's attention mask carries the sequence bucket); and one
packer unpacks every model's outputs, so every model returns :data:`OUTPUTS` tensors
before its aliased ones (one-element pads where a graph has fewer).

The sampler's per-slot tables (``counts``, ``logit_bias``, masks: ``slots x vocab``)
stay graph inputs and outputs: they cross to the device and back every step, the
transfer still left on this path (docs/neuron.md).

Nothing here ran on a Neuron device (none was available): it is checked against a
recording stand-in of torch-neuronx and neuronx-distributed (``tests/neuron_standin``)
that runs the models on the CPU with these semantics: compiler flags parsed (an
unknown one is an error, and without ``--auto-cast=none`` float32 matmuls are rounded
to bfloat16), state updated only through aliases, weights and state kept on the
device and every byte that crosses counted, one thread per core with real
collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
import torch.nn.functional as F

from polyengine.errors import InvalidRequest
from polyengine.models import ModelConfig

from polyengine.backends.torch_common.model import TorchWeights
from polyengine.pages import pages_for

from polyengine.backends.neuron.graphs import (
    SAMPLER_FIELDS, ContextContinuation, ContextEncoding, PagedContextContinuation, PagedContextEncoding,
    PagedTokenGeneration, TokenGeneration,
)

__all__ = [
    "COMPILER_ARGS", "OUTPUTS", "compiler_args", "local_config", "local_shape", "shards", "tp_linear", "OnDevice", "ProgramSpec",
    "DeviceGraphs", "compile_program", "load_program",
]

COMPILER_ARGS = {
    "float32": "--model-type=transformer -O2 --auto-cast=none",
    "bfloat16": "--model-type=transformer -O2 --auto-cast=none --enable-mixed-precision-accumulation",
}
OUTPUTS = 4  # every model's non-aliased outputs (NxD unpacks all models with one packer)
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output rows
_ROW = ("o_proj", "down_proj")  # split by input columns, summed over the cores


def compiler_args(dtype: str) -> str:
    """neuronx-cc's arguments for a graph declared in ``dtype``."""
    try:
        return COMPILER_ARGS[dtype]
    except KeyError:
        raise InvalidRequest(f"the Neuron path compiles {', '.join(COMPILER_ARGS)}, not {dtype!r}") from None


def local_config(config: ModelConfig, tp: int) -> ModelConfig:
    """One core's share of ``config`` under tensor parallelism ``tp``: its heads, KV
    heads and MLP units (whole ones: the sizes must divide, else InvalidRequest)."""
    for what, size in (("attention heads (num_attention_heads)", config.num_attention_heads),
                       ("KV heads (num_key_value_heads)", config.num_key_value_heads),
                       ("MLP width (intermediate_size)", config.intermediate_size)):
        if size % tp:
            raise InvalidRequest(f"option tp_degree={tp} does not divide the model's {size} {what}: each NeuronCore "
                                 f"holds whole heads; use a tp_degree that divides {size}")
    if tp == 1:
        return config
    return config.model_copy(update={"num_attention_heads": config.num_attention_heads // tp,
                                      "num_key_value_heads": config.num_key_value_heads // tp,
                                      "intermediate_size": config.intermediate_size // tp})


def _split(name: str) -> int | None:
    """The dimension a weight is split along over the cores (None: whole on every core)."""
    base, leaf = name.rsplit(".", 1)
    proj = base.rsplit(".", 1)[-1]
    if proj in _COLUMN:
        return 0  # weight rows and bias entries: this core's heads / MLP units
    if proj in _ROW and leaf == "weight":
        return 1  # the inputs this core's heads / units produce; the bias is added once, after the sum
    return None


def local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape of one core's part of weight ``name``."""
    dim = None if tp == 1 else _split(name)
    return shape if dim is None else shape[:dim] + (shape[dim] // tp,) + shape[dim + 1:]


def shards(tensors: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    """``tensors`` (HF names) split for each of ``tp`` cores."""
    out = []
    for rank in range(tp):
        part = {}
        for name, t in tensors.items():
            dim = None if tp == 1 else _split(name)
            if dim is None:
                part[name] = t
            else:
                size = t.shape[dim] // tp
                part[name] = t.narrow(dim, rank * size, size).contiguous()
        out.append(part)
    return out


def tp_linear(tensors: dict[str, torch.Tensor], x: torch.Tensor, name: str) -> torch.Tensor:
    """The forward's projections on one core (``StepSpec.linear``): its rows of q/k/v and
    gate/up; its columns of o and down, summed over the tensor-parallel group (NxD's
    all-reduce) before the bias; the whole LM head."""
    if name == "lm_head":
        return F.linear(x, tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]))
    w, b = tensors[name + ".weight"], tensors.get(name + ".bias")
    if name.rsplit(".", 1)[-1] in _ROW:
        from neuronx_distributed.parallel_layers.mappings import reduce_from_tensor_model_parallel_region

        y = reduce_from_tensor_model_parallel_region(F.linear(x, w))
        return y if b is None else y + b
    return F.linear(x, w, b)


def _gather_heads(x: torch.Tensor) -> torch.Tensor:
    """``(L, B, heads/tp, P, D)`` on each core -> every core's heads, in rank order."""
    from neuronx_distributed.parallel_layers.mappings import gather_from_tensor_model_parallel_region

    whole = gather_from_tensor_model_parallel_region(x.movedim(2, -1).contiguous())  # heads last: (L, B, P, D, heads)
    return whole.movedim(-1, 2).contiguous()


def _param(name: str) -> str:
    return name.replace(".", "__")  # parameter names may not contain dots


def _pad(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=like.device)


class OnDevice(torch.nn.Module):
    """One graph as NxD traces it, for one core: the weights it reads as parameters
    (``weights.<name>``), the KV cache as state parameters (``k_cache``, ``v_cache``),
    a call's data as its inputs. ``forward`` returns :data:`OUTPUTS` tensors, then the
    caches' new values; :meth:`aliases` ties each cache to its output.

    Kinds: ``context`` (inputs ``tokens (B, P)``, ``last (B,)``, ``B`` 1 or a batched
    prefill's rows; outputs logits, the prompts' K and V with every core's heads), ``decode``/``draft`` (inputs
    ``seq_ids``, ``occupied``, ``prompt_len``, [``drafts``], the sampler's fields in
    :data:`~.graphs.SAMPLER_FIELDS` order, the bucket marker ``(kv_len,)``; outputs
    packed, counts, step, last token; a draft model reads and writes the first
    ``draft_layers`` layers of the cache), ``insert`` (inputs the prefix's K and V
    padded to a prefill bucket, ``slot (1,)``; writes them into the slot's cache row),
    ``continuation`` (inputs a whole prefix's K and V padded to its prefix bucket, its
    length ``start (1,)``, ``tokens (1, P)``, ``last (1,)``; outputs as ``context``'s,
    prefix and prompt together; no state).

    ``paged`` (option ``page_size``): the state is the two block pools ``(layers, blocks,
    kv_heads, block_size, head_dim)`` (this core's heads); ``context`` and
    ``continuation`` take a slot mapping (and a continuation its prefix's block row
    instead of its K/V, and last the bucket marker ``(Q,)``: two prefix buckets within
    one block's width would take inputs of the same shapes) and write the prompt's K/V
    into the pools, returning only the logits; ``decode``/``draft`` take the block table
    first; ``copy`` (inputs ``src (1,)``, ``dst (1,)``) copies a block in both pools (a
    copy on write); there is no insert.
    """

    def __init__(self, kind: str, *, graph: torch.nn.Module | None, weights: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 cache: tuple[tuple[int, ...], torch.dtype] | None, draft_layers: int = 0, tp: int = 1,
                 paged: bool = False):
        super().__init__()
        self.kind, self.graph, self.draft_layers, self.tp, self.paged = kind, graph, draft_layers, tp, paged
        self.names = tuple(weights)
        self.weights = torch.nn.ParameterDict({
            _param(n): torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            for n, (shape, dtype) in weights.items()})
        if kind == "insert" or (kind == "continuation" and not paged):  # takes its heads of a whole prefix
            self.tp_rank = torch.nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False)
        if cache is not None:
            shape, dtype = cache
            self.k_cache = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            self.v_cache = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)

    def aliases(self) -> dict[torch.nn.Parameter, int]:
        """The state parameters and the outputs that are their new values."""
        if self.kind in ("context", "continuation") and not self.paged:
            return {}
        return {self.k_cache: OUTPUTS, self.v_cache: OUTPUTS + 1}

    def _weights(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.weights[_param(n)] for n in self.names)

    def forward(self, *inputs: torch.Tensor):
        if self.paged and self.kind in ("context", "continuation"):  # the prompt's K/V into this core's pools
            if self.kind == "continuation":
                inputs = inputs[:-1]  # the prefix bucket's marker: routing only
            logits, k, v = self.graph(self._weights(), self.k_cache, self.v_cache, *inputs)
            return logits, _pad(logits), _pad(logits), _pad(logits), k, v
        if self.kind == "copy":
            return self._copy(*inputs)
        if self.kind == "context":
            tokens, last = inputs
            logits, k, v = self.graph(self._weights(), tokens, last)
            if self.tp > 1:
                k, v = _gather_heads(k), _gather_heads(v)
            return logits, k, v, _pad(tokens)
        if self.kind == "continuation":
            k_prefix, v_prefix, start, tokens, last = inputs
            mine = self._mine(self.graph.config.num_key_value_heads, tokens.device)
            logits, k, v = self.graph(self._weights(), k_prefix.index_select(2, mine), v_prefix.index_select(2, mine),
                                      start, tokens, last)
            if self.tp > 1:
                k, v = _gather_heads(k), _gather_heads(v)
            return logits, k, v, _pad(tokens)
        if self.kind == "insert":
            return self._insert(*inputs)
        return self._decode(*inputs)

    def _mine(self, heads: int, device: torch.device) -> torch.Tensor:
        """This core's KV heads among a whole prefix's: ``(heads,)`` indices."""
        return self.tp_rank * heads + torch.arange(heads, device=device)

    def _insert(self, k_prefix: torch.Tensor, v_prefix: torch.Tensor, slot: torch.Tensor):
        mine = self._mine(self.k_cache.shape[2], slot.device)  # this core's KV heads
        out = []
        for cache, prefix in ((self.k_cache, k_prefix), (self.v_cache, v_prefix)):
            row = cache.index_select(1, slot)  # (L, 1, heads, S, D)
            row = row.slice_scatter(prefix.index_select(2, mine).to(cache.dtype), dim=3, start=0, end=prefix.shape[3])
            out.append(cache.index_copy(1, slot, row))
        return slot.to(torch.int32), _pad(slot), _pad(slot), _pad(slot), out[0], out[1]

    def _copy(self, src: torch.Tensor, dst: torch.Tensor):
        """Block ``dst`` of both pools := block ``src``, in every layer."""
        out = [cache.index_copy(1, dst, cache.index_select(1, src)) for cache in (self.k_cache, self.v_cache)]
        return dst.to(torch.int32), _pad(dst), _pad(dst), _pad(dst), out[0], out[1]

    def _decode(self, *inputs: torch.Tensor):
        table, inputs = (inputs[:1], inputs[1:]) if self.paged else ((), inputs)  # paged: the block table first
        seq_ids, occupied, prompt_len, token_mask, masked = inputs[:5]
        fields = len(SAMPLER_FIELDS)
        drafts = inputs[5:-1 - fields]
        sampler = dict(zip(SAMPLER_FIELDS, inputs[-1 - fields:-1]))
        k, v = self.k_cache, self.v_cache
        layers = self.draft_layers or k.shape[0]
        packed, counts, step, last, k_new, v_new = self.graph(self._weights(), k[:layers], v[:layers], *table, seq_ids,
                                                              occupied, prompt_len, token_mask, masked, *drafts, sampler)
        if layers < k.shape[0]:  # the draft writes the target's first layers; the rest stay as they are
            k_new, v_new = torch.cat([k_new, k[layers:]]), torch.cat([v_new, v[layers:]])
        return packed, counts, step, last, k_new, v_new


@dataclass
class ProgramSpec:
    """What one artifact is built from: per key, a factory of its (core-local) module and
    its example inputs; the cores; the compiler's arguments; the rank-0 checkpoint
    (NxD's builder asks for a loader; the weights themselves are given at load)."""

    models: dict[str, tuple[Callable[[], OnDevice], tuple[torch.Tensor, ...]]]
    tp_degree: int
    # No input is updated in place (the compile seam's aliases): the caches are the program's own state.
    aliases: ClassVar[tuple] = ()
    compiler_args: str
    checkpoint: Callable[[], dict[str, torch.Tensor]]


def compile_program(spec: ProgramSpec, workdir: Path) -> Any:
    """Trace and compile every model of ``spec`` with NxD's ModelBuilder, weights left
    out (``workdir``: neuronx-cc's intermediate files); return it. The artifact cache
    saves it (``torch.jit.save``) as a signed entry (``polyengine.cache.store``)."""
    from neuronx_distributed.trace.model_builder import BaseModelInstance, ModelBuilder

    class Instance(BaseModelInstance):
        def __init__(self, factory):
            super().__init__(module_cls=factory, input_output_aliases={})

        def load_module(self):
            self.module = self.module_cls()

        def get(self, bucket_rank, **kwargs):
            return self.module, self.module.aliases()

    signatures = {}
    for key, (_, example) in spec.models.items():  # NxD routes calls by input shapes: each key needs its own
        shapes = str([list(t.shape) for t in example])
        if shapes in signatures:
            raise ValueError(f"models {signatures[shapes]!r} and {key!r} take inputs of the same shapes {shapes}")
        signatures[shapes] = key
    builder = ModelBuilder(router=None, tp_degree=spec.tp_degree, checkpoint_loader=spec.checkpoint,
                           compiler_workdir=str(workdir))
    for key, (factory, example) in spec.models.items():
        builder.add(key=key, model_instance=Instance(factory), example_inputs=[example], compiler_args=spec.compiler_args)
    return builder.trace(initialize_model_weights=False)


def load_program(path: Path) -> Any:
    """An artifact :func:`compile_program` wrote, loaded without weights (``initialize`` next)."""
    import neuronx_distributed  # noqa: F401  (registers NxD's TorchScript classes)
    import torch_neuronx  # noqa: F401  (registers the Neuron ops torch.jit.load needs)

    return torch.jit.load(str(path))


class DeviceGraphs:
    """An engine's graphs on the NeuronCores: builds the :class:`ProgramSpec` from the
    engine's buckets, then, given the compiled program, moves the weights to the cores
    once and runs the calls. The KV cache lives in the program (one per engine): a row
    per slot, or with ``pages`` (blocks, block size) the block pools."""

    def __init__(self, *, weights: TorchWeights, names: tuple[str, ...], draft: ModelConfig | None,
                 draft_names: tuple[str, ...], buckets, max_slots: int, max_cache_length: int, tokens_per_step: int,
                 num_top: int, neutral: Callable[[int], dict[str, torch.Tensor]],
                 no_masks: Callable[[int], tuple[torch.Tensor, torch.Tensor]], dtype: str, tp: int,
                 prefill_batch: tuple[int, ...] = (), pages: tuple[int, int] | None = None):
        self.config = weights.config
        self.prefill_batch = prefill_batch  # row counts of the batched context models (option batched_prefill)
        self.continuations = buckets.continuations  # (prefix, prompt) bucket pairs (option prefix_reuse)
        self.tp = tp
        self.local = local_config(self.config, tp)
        self.draft_local = local_config(draft, tp) if draft is not None else None
        self.weights, self.names, self.draft, self.draft_names = weights, names, draft, draft_names
        self.buckets, self.slots, self.max_cache_length = buckets, max_slots, max_cache_length
        self.k, self.num_top, self.neutral, self.dtype = tokens_per_step, num_top, neutral, dtype
        self.no_masks = no_masks  # the allowed-token mask inputs of a step without masks
        self.program: Any = None
        self._shapes = {n: (local_shape(n, tuple(weights.tensors[n].shape), tp), weights.tensors[n].dtype) for n in names}
        c = self.local
        self.pages = pages  # (blocks, block size): the block pools (option page_size)
        rows, length = pages if pages else (max_slots, buckets.cache)
        self._cache = ((c.num_hidden_layers, rows, c.num_key_value_heads, length, c.head_dim), weights.dtype)

    # -- what is compiled ------------------------------------------------------------------

    def description(self) -> dict[str, Any]:
        """The artifact's bucket plan and cores, for its cache key."""
        b = self.buckets
        return {"prefill": list(b.prefill), "batch": list(b.batch), "seq": list(b.seq), "positions": b.cache,
                "slots": self.slots, "max_cache_length": self.max_cache_length, "tokens_per_step": self.k,
                "num_top": self.num_top, "draft_layers": self.draft.num_hidden_layers if self.draft else 0,
                "tp_degree": self.tp, "compiler_args": compiler_args(self.dtype),
                **({"prefill_batch": list(self.prefill_batch)} if self.prefill_batch else {}),
                **({"continuations": [list(c) for c in self.continuations]} if self.continuations else {}),
                **({"pages": list(self.pages)} if self.pages else {})}

    def _linear(self):
        return tp_linear if self.tp > 1 else None

    def _decode_inputs(self, batch: int, tokens: int, kv: int) -> tuple[torch.Tensor, ...]:
        r = self.slots
        table = [torch.zeros((r, pages_for(kv, self.pages[1])), dtype=torch.int64)] if self.pages else []
        args = [*table, torch.arange(batch), torch.zeros(r, dtype=torch.bool), torch.zeros(r, dtype=torch.int64),
                *self.no_masks(r)]
        if tokens > 1:
            args.append(torch.zeros((batch, tokens - 1), dtype=torch.int64))
        sampler = self.neutral(r)
        return (*args, *(sampler[f] for f in SAMPLER_FIELDS), self.marker(kv))

    def _continuation_inputs(self, q: int) -> tuple[torch.Tensor, ...]:
        c = self.config  # the prefix whole: every core takes its own heads of it
        prefix = torch.zeros((c.num_hidden_layers, 1, c.num_key_value_heads, q, c.head_dim), dtype=self.weights.dtype)
        return prefix, prefix.clone(), torch.tensor([0])

    @staticmethod
    def marker(kv: int) -> torch.Tensor:
        """The bucket marker: its shape says which attended length a decode call is for."""
        return torch.zeros(kv, dtype=torch.int32)

    def spec(self) -> ProgramSpec:
        models: dict[str, tuple[Callable[[], OnDevice], tuple]] = {}
        self._prefill_models(models)
        b, lin = self.buckets, self._linear()
        draft_shapes = {n: self._shapes[n] for n in self.draft_names}
        cfg = dict(max_cache_length=self.max_cache_length, num_top=self.num_top, linear=lin)
        step = PagedTokenGeneration if self.pages else TokenGeneration
        if self.pages:  # a copy on write: one block of both pools
            models["copy_block"] = (lambda: OnDevice("copy", graph=None, weights={}, cache=self._cache, tp=self.tp,
                                                     paged=True),
                                    (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)))
        for batch in b.batch:
            for kv in b.seq:
                models[f"decode_{batch}_{kv}"] = (
                    lambda batch=batch, kv=kv: OnDevice(
                        "decode", graph=step(self.local, self.names, batch=batch, tokens=self.k, kv_len=kv, **cfg),
                        weights=self._shapes, cache=self._cache, tp=self.tp, paged=bool(self.pages)),
                    self._decode_inputs(batch, self.k, kv))
                if self.draft is not None:
                    layers = self.draft.num_hidden_layers
                    models[f"draft_{batch}_{kv}"] = (
                        lambda batch=batch, kv=kv: OnDevice(
                            "draft", graph=step(self.draft_local, self.draft_names, batch=batch, tokens=1, kv_len=kv,
                                                **cfg),
                            weights=draft_shapes, cache=self._cache, draft_layers=layers, tp=self.tp,
                            paged=bool(self.pages)),
                        self._decode_inputs(batch, 1, kv))
        return ProgramSpec(models, self.tp, compiler_args(self.dtype), lambda: self.checkpoints()[0])

    def _prefill_models(self, models: dict) -> None:
        """The context (of one row, and of several with ``prefill_batch``), insert and
        continuation models. With pages a prompt's K/V go straight into the pools through
        its slot mapping (no insert model: a slot shares its prefix's blocks)."""
        lin, paged = self._linear(), bool(self.pages)
        context = PagedContextEncoding if paged else ContextEncoding
        continuation = PagedContextContinuation if paged else ContextContinuation

        def on_device(kind: str, graph: Callable[[], torch.nn.Module]) -> Callable[[], OnDevice]:
            return lambda: OnDevice(kind, graph=graph(), weights=self._shapes, cache=self._cache if paged else None,
                                    tp=self.tp, paged=paged)

        def prompts(n: int, p: int) -> tuple[torch.Tensor, ...]:  # padded prompts, last positions[, slot mapping]
            slots = (torch.zeros(n * p, dtype=torch.int64),) if paged else ()
            return (torch.zeros((n, p), dtype=torch.int64), torch.full((n,), p - 1), *slots)

        for p in self.buckets.prefill:
            models[f"context_{p}"] = (on_device("context", lambda p=p: context(self.local, self.names, p, linear=lin)),
                                      prompts(1, p))
            for n in self.prefill_batch:  # several prompts of this bucket: inputs (n, P), (n,)
                models[f"context_{n}x{p}"] = (on_device("context", lambda p=p, n=n: context(
                    self.local, self.names, p, linear=lin, batch=n)), prompts(n, p))
            if not paged:
                full = (self.config.num_hidden_layers, 1, self.config.num_key_value_heads, p, self.config.head_dim)
                models[f"insert_{p}"] = (
                    lambda: OnDevice("insert", graph=None, weights={}, cache=self._cache, tp=self.tp),
                    (torch.zeros(full, dtype=self.weights.dtype), torch.zeros(full, dtype=self.weights.dtype),
                     torch.zeros(1, dtype=torch.int64)))
        for q, p in self.continuations:
            if paged:  # the prefix's block row and length; the prefix bucket's marker last
                head = (torch.zeros(pages_for(q, self.pages[1]), dtype=torch.int64), torch.tensor([0]))
                tail = (self.marker(q),)
            else:
                head, tail = self._continuation_inputs(q), ()
            models[f"continuation_{q}_{p}"] = (on_device("continuation", lambda q=q, p=p: continuation(
                self.local, self.names, q, p, linear=lin)), (*head, *prompts(1, p), *tail))

    def checkpoints(self) -> list[dict[str, torch.Tensor]]:
        """Each core's weights under the models' parameter names (what ``initialize`` takes)."""
        parts = shards({n: self.weights.tensors[n] for n in self.names}, self.tp)
        return [{**{f"weights.{_param(n)}": t for n, t in part.items()}, "tp_rank": torch.tensor([rank])}
                for rank, part in enumerate(parts)]

    # -- running -----------------------------------------------------------------------------

    def attach(self, program: Any) -> None:
        """Take a loaded program and move the engine's weights to its cores (once)."""
        program.nxd_model.initialize(self.checkpoints(), torch.tensor([0], dtype=torch.int32))
        self.program = program

    def _run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.program(*inputs)
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)

    def context(self, tokens: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, k, v, _ = self._run(tokens, last)
        return logits, k, v

    def continuation(self, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, tokens: torch.Tensor,
                     last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A prompt continuing a prefix (``k``/``v`` padded to its prefix bucket, as the
        CPU compile path's continuation graph takes them): logits, prefix and prompt's K/V."""
        logits, k, v, _ = self._run(k, v, start, tokens, last)
        return logits, k, v

    def on_pools(self, base: tuple, *inputs: torch.Tensor) -> torch.Tensor:
        """A prefill into the block pools, graph ``base`` (its kind and buckets; inputs
        ``(tokens, last, slot_mapping)``, or a continuation's ``(block_row, start, tokens,
        last, slot_mapping)``, its prefix bucket's marker added here; the inputs' shapes
        pick the model): its logits; the K/V stay on the cores."""
        marker = (self.marker(base[1]),) if base[0] == "continuation" else ()
        return self._run(*inputs, *marker)[0]

    def copy(self, copies: list[tuple[int, int]]) -> None:
        """Copies on write: each (src, dst) block of both pools, one call each."""
        for src, dst in copies:
            self._run(torch.tensor([src]), torch.tensor([dst]))

    def insert(self, k: torch.Tensor, v: torch.Tensor, slot: int) -> None:
        """The prefix ``(L, kv_heads, n, D)`` into ``slot``'s cache row, padded to its prefill bucket."""
        n = k.shape[2]
        bucket = next(p for p in self.buckets.prefill if p >= n)
        shape = (k.shape[0], 1, k.shape[1], bucket, k.shape[3])
        kp, vp = torch.zeros(shape, dtype=self.weights.dtype), torch.zeros(shape, dtype=self.weights.dtype)
        kp[:, 0, :, :n], vp[:, 0, :, :n] = k, v
        self._run(kp, vp, torch.tensor([slot]))

    def decode(self, kv: int, seq_ids: torch.Tensor, occupied: torch.Tensor, prompt_len: torch.Tensor,
               masks: tuple[torch.Tensor, torch.Tensor], drafts: tuple[torch.Tensor, ...],
               sampler: dict[str, torch.Tensor], table: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, ...]:
        """One decode (or speculation, or draft) call: ``(packed, counts, step, last_token)``;
        which model runs follows from the inputs' shapes. ``table``: with pages, the block table."""
        return self._run(*table, seq_ids, occupied, prompt_len, *masks, *drafts, *(sampler[f] for f in SAMPLER_FIELDS),
                         self.marker(kv))

