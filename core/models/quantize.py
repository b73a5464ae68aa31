"""int8 weights: the one quantizer and the one mode table every backend uses.

A backend's option ``quantize`` names a mode of :data:`WEIGHT_MODES`; the backend asks
:func:`quantize_model` for the int8 copies and only moves them where it computes
(the ``cpu`` backend wraps them as torch tensors, ``tpu_jax`` puts them on its mesh). What is
quantized: every projection (``*_proj.weight``) and the LM head (the embedding table when
tied, which itself stays float: it is a lookup). Each matrix ``W`` ``[out, in]`` becomes

- ``<name>.qweight``: int8 ``[out, in]``, ``round(W / scale)`` clipped to [-127, 127]
  (symmetric: -128 is never used, so negating a weight never overflows);
- ``<name>.scale``: float32, ``absmax / 127`` of each output row (``"int8"``, shape
  ``[out]``) or of each block of 32 weights along a row (``"int8-block32"``, shape
  ``[out, in / 32]``). A matrix whose rows do not divide into blocks gets per-row
  scales; a block of zeros gets scale 1 (its weights are 0 either way).

``W ~ qweight * scale`` (broadcast per row or per block): :func:`dequantize_matrix`.
Rounding is half to even, in float32, so the result is the same bits whatever computed
it; NumPy here, chunked by rows so that the float temporaries stay small whatever the
matrix (the LM head of a large vocabulary included).

Each matrix is read from the Model's records one at a time (``model.weights[name]``
converts that one tensor: a Q4_K or BF16 record is dequantized, exactly, then rounded
to float32) and requantized, so the peak is the int8 copies plus one float tensor and
its chunked temporaries, never a float32 model (``tests/test_quantized_weights.py``
measures the process's peak RSS).

The copies are computed once per :class:`~polyengine.models.Model` and mode and kept
with it (engines built one after another over one Model share them). A Model loaded
for exactly one engine (``Model.exclusive``) releases each float matrix as soon as its
int8 copy exists (``Model.release``; a memory-mapped record frees little, a record
widened at load frees its float array). The Model's fingerprint (a hash of the float weights, which portable
prefixes carry) is computed before anything is released.
"""

from __future__ import annotations

import weakref
import numpy as np

from polyengine.errors import InvalidRequest
from polyengine.memory import return_freed_memory
from polyengine.models.config import ModelConfig
from polyengine.models.model import Model

__all__ = ["WEIGHT_MODES", "check_mode", "quantize_matrix", "dequantize_matrix", "quantized_names",
           "quantize_model", "replace_matrices", "has_int8_copies", "int8_bytes", "matrix_bytes", "group_of",
           "replaced_weights"]

# option value -> weights per scale along a row (0: one scale per output row)
WEIGHT_MODES = {"int8": 0, "int8-block32": 32}
# Rows quantized at a time: about 1 MiB per float32 temporary, whatever the matrix.
_CHUNK_ELEMENTS = 1 << 18
# Released float bytes after which the freed heap memory is handed back to the system.
_RETURN_BYTES = 64 << 20
# Formats the float view reads as they are stored (a view, no conversion).
_READ_AS_STORED = frozenset({"F64", "F32", "F16"})

# Model -> mode -> {"<name>.qweight": ..., "<name>.scale": ...}; dies with its Model.
_CACHE: "weakref.WeakKeyDictionary[Model, dict[str, dict[str, np.ndarray]]]" = weakref.WeakKeyDictionary()


def check_mode(mode: str, option: str = "quantize") -> str:
    """``mode`` if it is ``""`` (no quantization) or a key of :data:`WEIGHT_MODES`."""
    if mode != "" and mode not in WEIGHT_MODES:
        raise InvalidRequest(f"option {option}={mode!r}: use one of {['', *WEIGHT_MODES]}")
    return mode


def group_of(mode: str, columns: int) -> int:
    """Weights per scale for a matrix of ``columns`` inputs under ``mode`` (0: per row)."""
    group = WEIGHT_MODES[mode]
    return group if group and columns % group == 0 else 0


def quantize_matrix(w: np.ndarray, group: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 of ``w`` ``[out, in]``: per row (``group`` 0, scale ``[out]``) or
    per ``group`` weights of a row (scale ``[out, in / group]``; ``in`` must divide)."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"quantize_matrix takes a 2-D matrix, got shape {w.shape}")
    n, k = w.shape
    if group and k % group:
        raise ValueError(f"{k} columns do not divide into blocks of {group}")
    width = group or k
    q = np.empty((n, k), np.int8)
    scale = np.empty((n, k // group) if group else (n,), np.float32)
    step = max(1, _CHUNK_ELEMENTS // max(k, 1))
    for r in range(0, n, step):
        blocks = np.asarray(w[r: r + step], np.float32).reshape(-1, k // width, width)
        s = np.abs(blocks).max(axis=2) / np.float32(127.0)  # (rows, blocks)
        s = np.where(s > 0, s, np.float32(1.0)).astype(np.float32)
        q[r: r + step] = np.clip(np.rint(blocks / s[:, :, None]), -127, 127).astype(np.int8).reshape(-1, k)
        scale[r: r + step] = s if group else s[:, 0]
    return q, scale


def dequantize_matrix(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``qweight * scale`` as float32 ``[out, in]`` (the inverse up to the rounding)."""
    n, k = q.shape
    if scale.ndim == 1:
        return q.astype(np.float32) * scale[:, None]
    return (q.astype(np.float32).reshape(n, scale.shape[1], -1) * scale[:, :, None]).reshape(n, k)


def quantized_names(config: ModelConfig) -> list[tuple[str, str]]:
    """``(name, source)`` for every matrix that is quantized: ``name`` is what the int8
    entries are called (``<name>.qweight``/``.scale``), ``source`` the float weight they
    replace (the LM head of a tied model reads the embedding table)."""
    out = [(n[: -len(".weight")], n) for n in config.weight_shapes() if n.endswith("_proj.weight")]
    out.append(("lm_head", config.head_weight))
    return out


def matrix_bytes(shape: tuple[int, int], mode: str) -> int:
    """The bytes of one ``[out, in]`` matrix's int8 copy under ``mode``: weights and scales."""
    n, k = shape
    group = group_of(mode, k)
    return n * k + 4 * (n * (k // group) if group else n)


def int8_bytes(config: ModelConfig, mode: str) -> int:
    """The bytes of the int8 copies ``mode`` makes of ``config``'s matrices (weights and scales)."""
    shapes = config.weight_shapes()
    return sum(matrix_bytes(shapes[source], mode) for _, source in quantized_names(config))


def has_int8_copies(model: Model, mode: str) -> bool:
    """Whether :func:`quantize_model` already holds ``model``'s copies for ``mode``."""
    return mode in _CACHE.get(model, {})


def quantize_model(model: Model, mode: str) -> dict[str, np.ndarray]:
    """The int8 copies of ``model``'s projections and LM head for ``mode`` (see the module
    docstring), computed on first use and kept with the Model. When the Model is
    ``exclusive``, every float matrix they replace (the embedding table excepted) is
    released from ``model.weights`` as soon as its copy exists."""
    check_mode(mode)
    if not mode:
        raise ValueError("quantize_model needs a mode, not ''")
    per_model = _CACHE.setdefault(model, {})
    if mode in per_model:
        return per_model[mode]
    out: dict[str, np.ndarray] = {}

    def int8(name: str, w: np.ndarray) -> None:
        out[name + ".qweight"], out[name + ".scale"] = quantize_matrix(w, group_of(mode, w.shape[1]))

    replace_matrices(model, int8, why=f"its int8 copy ({mode}) replaced it")
    per_model[mode] = out
    return out


def replace_matrices(model: Model, copy, *, why: str) -> None:
    """Call ``copy(name, matrix)`` for every projection and the LM head
    (:func:`quantized_names`), releasing each float matrix from an exclusive Model as soon
    as its copy exists (the embedding table excepted: it stays a lookup), with ``why``
    as the reason a later read is refused. The fingerprint is computed first. A matrix
    stored in another format than F32/F16/F64 (blocks, BF16) is converted as it is read:
    that float matrix is a temporary, dropped and its memory handed back to the system
    before the next one is converted, so conversions never add up (NumPy's arrays of a
    few MiB come from the C heap, which keeps freed memory resident until trimmed:
    measured, the temporaries of a 125 MB-as-float32 Q4_K model's requantization held 22
    MB). Released float matrices are handed back every 64 MiB. The one place int8 copies
    (here) and the cpu backend's bfloat16 copies are made."""
    if model.exclusive:
        model.fingerprint  # noqa: B018 -- of the float weights, before any is released
    unreturned = 0  # bytes released since memory was last handed back to the system
    for name, source in quantized_names(model.config):
        temporary = model.weights.record(source).format not in _READ_AS_STORED
        w = model.weights[source]
        copy(name, w)
        freed = w.nbytes
        del w  # before the next matrix is read: one converted matrix at a time
        if model.exclusive and source != "model.embed_tokens.weight":
            model.release([source], why=why)
            unreturned += freed
        if temporary or unreturned >= _RETURN_BYTES:
            return_freed_memory()
            unreturned = 0
    if unreturned:
        return_freed_memory()


def replaced_weights(config: ModelConfig) -> frozenset[str]:
    """The float weights an engine with int8 weights does not keep: every projection and
    an untied LM head (the embedding table stays, it is a lookup)."""
    return frozenset(s for _, s in quantized_names(config)) - {"model.embed_tokens.weight"}
