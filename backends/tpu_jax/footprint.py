"""What a tpu_jax engine holds on each device, computed without JAX.

The single-host engine checks these bytes against each device's free memory before it
allocates; the Ray leader (``ray_engine.py``) uses the same numbers to check, per host,
the share that host's workers will hold, before any worker allocates. Both need the
mesh's shape and the sharding of each array, so those live here, JAX-free:

- :func:`mesh_shape`: the ``(dp, tp)`` a number of devices is split into (0 chooses;
  explicit sizes are checked, naming both numbers).
- :func:`param_axes`: the logical axes of a weight by its HF name.
- :func:`shards`: into how many pieces the mesh splits an array (a dimension the mesh
  axis does not divide stays whole).
- :func:`device_needs`: bytes per device of the weights, the KV cache and the
  sampler's tables and a prefill's activations.

:mod:`.sharding` builds the JAX mesh from :func:`mesh_shape` and lays arrays out by the
same rules, so the counts here are the arrays' real per-device sizes.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from polyengine.engine import EngineConfig
from polyengine.errors import InvalidRequest
from polyengine.models import ModelConfig
from polyengine.models.int_blocks import FOUR_BIT_FORMATS, GROUP, OFFSET_FORMATS
from polyengine.models.quantize import matrix_bytes, replaced_weights
from polyengine.pages import pages_for
from polyengine.sampling.rows import row_bytes

from polyengine.backends.tpu_jax.options import DEFAULT_RULES

__all__ = ["ITEMSIZE", "KV_SCALE_BYTES", "CACHE_AXES", "POOL_AXES", "mesh_shape", "param_axes", "mesh_axes", "shards", "block_bytes",
           "device_needs"]

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_SCALE_BYTES = 4  # an int8 KV cache row stores its float32 scale beside the values (quantize.py)
CACHE_AXES = ("layers", "slots", "kv_heads", "positions", "head_dim")
# A page pool (option page_size): any page may hold any slot's K/V, so only the KV heads
# are split (over tp); under dp every device group holds the whole pool.
POOL_AXES = ("layers", "kv_heads", None, None, "head_dim")  # [layers, kv_heads, pages, page_size, head_dim]


def _divisors(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def mesh_shape(config: ModelConfig, slots: int, devices: int, *, tensor_parallel: int = 0,
               data_parallel: int = 0, platform: str = "none") -> tuple[int, int]:
    """``(dp, tp)`` for ``devices`` devices; refuses a mesh the model cannot split over.

    0 means "choose": ``tp`` becomes the largest divisor of the devices left that
    divides the heads, the KV heads and the MLP width; ``dp`` the largest that divides
    the devices left and the slots. Explicit sizes are checked, and a mismatch is
    InvalidRequest naming both numbers.
    """
    n = int(devices)
    tp, dp = int(tensor_parallel), int(data_parallel)
    if tp < 0 or dp < 0:
        raise InvalidRequest(f"tensor_parallel ({tp}) and data_parallel ({dp}) must be >= 0 (0 chooses)")
    splits = {
        "attention heads (num_attention_heads)": config.num_attention_heads,
        "KV heads (num_key_value_heads)": config.num_key_value_heads,
        "MLP width (intermediate_size)": config.intermediate_size,
    }
    if tp == 0:
        room = n // dp if dp else n
        tp = next(d for d in _divisors(max(room, 1)) if all(size % d == 0 for size in splits.values()))
    if dp == 0:
        dp = next(d for d in _divisors(max(n // tp, 1)) if slots % d == 0)
    if tp * dp > n:
        raise InvalidRequest(
            f"a mesh of data_parallel={dp} x tensor_parallel={tp} needs {tp * dp} devices but only {n} "
            f"are visible ({platform})")
    for what, size in splits.items():
        if size % tp:
            raise InvalidRequest(
                f"tensor_parallel={tp} does not divide the model's {size} {what}: each device must hold "
                f"whole heads; use a tensor_parallel that divides {size}")
    if slots % dp:
        raise InvalidRequest(
            f"data_parallel={dp} does not divide the {slots} slots (max_slots): each device group holds "
            f"slots/dp rows; use a data_parallel that divides {slots}")
    return dp, tp


def param_axes(name: str, ndim: int) -> tuple[str | None, ...]:
    """The logical axes of a weight tensor by its HF name (and ``.qweight``/``.scale``
    of int8 weights, which follow their matrix)."""
    leaf = name.rsplit(".", 1)[-1]
    base = name.rsplit(".", 1)[0]
    if base.startswith("rope"):
        return ("positions", "head_dim")
    if base.endswith(("q_norm", "k_norm")):
        return ("head_dim",)
    if base.endswith(".mlp.gate") and ndim == 2:  # the router (experts, embed)
        return (None, "embed")
    if ".mlp.experts." in base and ndim == 3:  # stacked experts (experts, out, in)
        return (None, *param_axes(base.replace(".mlp.experts.", ".mlp.") + "." + leaf, 2))
    if base in ("model.embed_tokens", "lm_head"):
        out, inp = "vocab", "embed"
    elif base.endswith(("q_proj", "qkv_proj")):
        out, inp = "heads", "embed"
    elif base.endswith(("k_proj", "v_proj")):
        out, inp = "kv_heads", "embed"
    elif base.endswith("o_proj"):
        out, inp = "embed", "heads"
    elif base.endswith(("gate_proj", "up_proj", "gate_up_proj")):
        out, inp = "mlp", "embed"
    elif base.endswith("down_proj"):
        out, inp = "embed", "mlp"
    else:  # norms
        return ("embed",)[:ndim]
    if leaf == "bias" or ndim == 1:  # a bias, or the per-channel scale of an int8 matrix
        return (out,)
    return (out, inp)


def mesh_axes(axes: Sequence[str | None], shape: Sequence[int] | None, mesh: Mapping[str, int],
              rules: Mapping[str, str | None]) -> list[str | None]:
    """The mesh axis of each dimension (None: whole); with ``shape``, a dimension the
    mesh axis does not divide stays whole (e.g. a block-scale column count)."""
    out = []
    for i, logical in enumerate(axes):
        axis = None if logical is None else rules[logical]
        if axis is not None and shape is not None and shape[i] % int(mesh[axis]):
            axis = None
        out.append(axis)
    return out


def shards(axes: Sequence[str | None], shape: Sequence[int], mesh: Mapping[str, int],
           rules: Mapping[str, str | None]) -> int:
    """Into how many pieces an array of ``shape`` is split (bytes per device = total / this)."""
    return math.prod(int(mesh[a]) for a in mesh_axes(axes, shape, mesh, rules) if a is not None)


def block_bytes(fmt: str, shape: tuple[int, int]) -> int:
    """The bytes of a matrix of ``shape`` kept as a file's ``fmt`` blocks
    (:func:`~.quantize.block_arrays`): int8 or two 4-bit values a byte, a float32 scale
    per group (32 weights, Q6_K's 16), and a float32 offset per group where the format
    has one."""
    n, k = shape
    values = n * k // 2 if fmt in FOUR_BIT_FORMATS else n * k
    return values + 4 * (n * k // GROUP[fmt]) * (2 if fmt in OFFSET_FORMATS else 1)


def device_needs(model: ModelConfig, config: EngineConfig, *, dtype: str, dp: int, tp: int,
                 quantize: str = "", kv_int8: bool = False,
                 rules: Mapping[str, str | None] | None = None,
                 blocks: Mapping[str, str] | None = None, page_size: int = 0, pool_pages: int = 0,
                 prefill_rows: int = 1) -> dict[str, int]:
    """Bytes per device of what an engine allocates: weights, KV cache, sampler tables
    and a prefill's activations, by description (what a memory refusal names).
    ``blocks``: weight name -> GGUF format of the matrices kept as a file's blocks
    (:func:`~.quantize.block_arrays`). ``page_size``: K/V in a pool of ``pool_pages``
    pages of that many positions instead of a cache row per slot (:data:`POOL_AXES`);
    ``pool_pages`` 0 is an unbounded pool, which starts at every slot's full context
    (paged.PagedKV.grow).
    ``prefill_rows``: the rows a prefill program runs at once (batched prefill: the
    largest batch size), which its activations scale with."""
    rules = {**DEFAULT_RULES, **(rules or {})}
    mesh = {"dp": dp, "tp": tp}
    item = ITEMSIZE[dtype]
    weights = 0
    replaced = replaced_weights(model) if quantize else frozenset()  # the core's one quantizer's choice
    for name, shape in model.weight_shapes().items():
        if name in replaced:
            size = matrix_bytes(shape, quantize)
        elif name in (blocks or {}):
            size = block_bytes(blocks[name], shape)
        else:
            size = math.prod(shape) * item
        weights += size // shards(param_axes(name, len(shape)), shape, mesh, rules)
    if quantize and model.tie_word_embeddings:  # the int8 copy of the tied head
        weights += matrix_bytes((model.vocab_size, model.hidden_size), quantize)
    rope = (config.max_cache_length, model.head_dim // 2)  # the cos and sin tables, in the compute dtype
    tables = 2 if model.rope_local_theta is not None else 1  # global, and Gemma 3's local (rope_tables)
    weights += tables * 2 * math.prod(rope) * item // shards(param_axes("rope.cos", 2), rope, mesh, rules)
    kv_item, width = (1, model.head_dim + KV_SCALE_BYTES) if kv_int8 else (item, model.head_dim)
    if page_size:
        pool_pages = pool_pages or config.max_slots * pages_for(config.max_cache_length, page_size)
        cache_shape = (model.num_hidden_layers, model.num_key_value_heads, pool_pages, page_size, width)
        cache = 2 * math.prod(cache_shape) * kv_item // shards(POOL_AXES, cache_shape, mesh, rules)
        what = f"the K/V pool of {pool_pages} pages x {page_size} positions"
    else:
        cache_shape = (model.num_hidden_layers, config.max_slots, model.num_key_value_heads, config.max_cache_length, width)
        cache = 2 * math.prod(cache_shape) * kv_item // shards(CACHE_AXES, cache_shape, mesh, rules)
        what = f"the KV cache of {config.max_slots} slots x {config.max_cache_length} positions"
    return {
        f"{dtype} weights{' (int8 projections)' if quantize or blocks else ''}": weights,
        what: cache,
        "the sampler's per-slot tables and a prefill's activations" + (
            f" ({prefill_rows} rows)" if prefill_rows > 1 else ""): (
            config.max_slots * row_bytes(model.vocab_size) // dp
            + prefill_rows * config.max_prefill_length * (model.vocab_size + 4 * model.intermediate_size) * 4),
    }
