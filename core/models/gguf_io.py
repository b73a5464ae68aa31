"""GGUF files to a ModelConfig and HF-named weight records (the file's own blocks).

A GGUF holds metadata (``general.architecture``, ``llama.*`` shape keys, the
tokenizer's vocabulary) and tensors under llama.cpp names, in ggml layout: dims are
listed innermost first (``ne``), so a ``[out, in]`` matrix reads ``[in, out]``.

Decisions:
- The header is parsed here rather than by ``gguf.GGUFReader``: the reader builds a
  NumPy view per metadata item and takes ~4.5 s on SmolLM2's 100k vocabulary strings;
  this parser takes a fraction of that and reports truncation and corruption with the
  byte offset and the tensor concerned.
- Tensors stay in their format as :class:`~polyengine.models.weights.Weight` records,
  read-only views of the file's memory map (:meth:`GGUFFile.load_records`): loading
  copies and converts nothing. Dequantization of the formats people download (Q8_0,
  Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) is this package's own, exact
  (:mod:`.blocks`); other ggml types go to ``gguf.quants.dequantize`` when converted.
- llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` (and their biases)
  for the ``llama`` architecture so that its RoPE can pair adjacent dims. That is
  undone per head, giving transformers' rotate-half layout bit for bit; on a record it
  is a strided view that moves whole rows of blocks (blocks run along the input
  dimension, so no block is split). ``qwen2``
  files are not permuted by the converter, so neither are they here.
- Llama 3.1-style RoPE scaling appears only as a ``rope_freqs.weight`` tensor of
  divisors; it is read into the config (see ``config_files.config_from_gguf``), not kept as a weight.
- Every tensor's type is checked before anything is converted: an unsupported
  quantization type is refused naming the tensor, the type and the supported ones.
- The header is untrusted: every count, length, nesting depth, dimension, offset and
  the alignment is checked against :mod:`polyengine.limits` and the file's size before
  it sizes a loop or an allocation, a key given twice is refused (which one is meant
  would be a guess), and weights must be finite (checked at load on the stored values,
  the f16 scales of blocks; again on every conversion).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from polyengine.errors import WeightsError
from polyengine.files import open_regular
from polyengine.limits import (
    MAX_GGUF_ALIGNMENT,
    MAX_GGUF_ARRAY,
    MAX_GGUF_ARRAY_TOTAL,
    MAX_GGUF_KEY_BYTES,
    MAX_GGUF_METADATA,
    MAX_GGUF_NESTING,
    MAX_GGUF_STRING_BYTES,
    MAX_GGUF_TENSORS,
    MAX_HEAD_DIM,
    MAX_TENSOR_DIMS,
)
from polyengine.models.config import ModelConfig
from polyengine.models.config_files import GGUF_ARCHITECTURES, config_from_gguf
from polyengine.models.metadata import Fields, require_finite
from polyengine.models.blocks import format_of_ggml, row_bytes
from polyengine.models.weights import Weight, format_info

__all__ = ["GGUFFile", "GGUFTensor", "read_gguf", "hf_name", "gguf_name", "unpermute_rows", "permute_rows"]

Progress = Callable[[int, int, str], None]

_MAGIC = b"GGUF"
_U64 = struct.Struct("<Q")
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct format (8 = string and 9 = array are handled apart).
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
# ggml types widened here without the gguf package; the rest go to gguf.quants.dequantize.
_F32, _F16, _BF16, _F64 = 0, 1, 30, 28
_FLOAT_NUMPY = {_F32: "<f4", _F16: "<f2", _BF16: "<u2", _F64: "<f8"}
# No ggml type stores more than about 5 elements per byte (the 1.5-bit ones); 8 is a
# safe bound on how many elements a file of a given size can describe.
_ELEMENTS_PER_BYTE = 8

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Gemma's norms sit elsewhere (sandwich norms): llama.cpp's ffn_norm is its pre-MLP norm.
_GEMMA_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_NOT_WEIGHTS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def hf_name(gguf_name: str, model_type: str = "llama") -> str | None:
    """The HF name of a llama.cpp tensor name (for fused or stacked tensors, the name of
    the fused tensor: ``self_attn.qkv_proj``, ``mlp.gate_up_proj``, ``mlp.experts.*_proj``),
    or None if it is not a weight of ``model_type``."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    table = dict(_LAYER_NAMES)
    if model_type in ("gemma2", "gemma3_text"):
        table.update(_GEMMA_NAMES)
    if model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
        table.update(_QK_NORMS)
    if model_type == "phi3":
        table.update({"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"})
    if model_type in ("mixtral", "qwen3_moe"):
        table.update({"ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
                      "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
                      "ffn_down_exps.weight": "mlp.experts.down_proj.weight"})
    name = table.get(parts[2])
    return None if name is None else f"model.layers.{int(parts[1])}.{name}"


def _parts(name: str, config: ModelConfig) -> tuple[list[str], int]:
    """The HF tensors a GGUF tensor holds and how they are joined: ``(names, 0)``
    concatenated along rows (Phi-3's fused projections), ``(names, -1)`` stacked
    (experts), ``([name], 0)`` for a plain tensor."""
    pre, sep, leaf = name.rpartition(".self_attn.qkv_proj.")
    if sep:
        return [f"{pre}.self_attn.{p}_proj.{leaf}" for p in "qkv"], 0
    pre, sep, leaf = name.rpartition(".mlp.gate_up_proj.")
    if sep:
        return [f"{pre}.mlp.gate_proj.{leaf}", f"{pre}.mlp.up_proj.{leaf}"], 0
    pre, sep, proj = name.rpartition(".mlp.experts.")
    if sep:
        return [f"{pre}.mlp.experts.{j}.{proj}" for j in range(config.num_experts)], -1
    return [name], 0


def _joined_shape(names: list[str], how: int, expected: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    if any(n not in expected for n in names):
        return None
    shapes = [expected[n] for n in names]
    if how == -1:
        return (len(shapes), *shapes[0])
    return (sum(s[0] for s in shapes), *shapes[0][1:])


def _split_record(record: Weight, names: list[str], how: int,
                  expected: dict[str, tuple[int, ...]]) -> dict[str, Weight]:
    """A fused (``how`` 0: row blocks) or stacked (``how`` -1) record's parts, as views."""
    if len(names) == 1:
        return {names[0]: record}
    if how == -1:
        return {n: record.select(j) for j, n in enumerate(names)}
    out, row = {}, 0
    for n in names:
        out[n] = record.row_slice(row, row + expected[n][0])
        row += expected[n][0]
    return out


def gguf_name(hf: str) -> str:
    """The llama.cpp tensor name of a Llama-family HF weight name (the writer's direction
    of :func:`hf_name`, for files this project writes: quantized test models)."""
    for gguf, name in _GLOBAL_NAMES.items():
        if name == hf:
            return gguf
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}." + next(gguf for gguf, name in _LAYER_NAMES.items() if name == rest)


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (what :func:`unpermute_rows` undoes): each
    head's two rotate-half halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: within each head it interleaved the two
    rotate-half halves (row pairs); put them back as first half, second half."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's place in the file. ``shape`` is NumPy order (``ne`` reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return _type_name(self.ggml_type)


@dataclass
class GGUFFile:
    """A parsed GGUF header: metadata and tensor table; no tensor data is read."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    data_start: int
    size: int
    _config: ModelConfig | None = field(default=None, repr=False)
    # The whole file mapped once, read-only (every record a view of it): one mapping, not one a tensor.
    _map: np.ndarray | None = field(default=None, repr=False)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def quantization_summary(self) -> str:
        """E.g. ``"Q4_1 x210, F32 x61, Q8_0 x1"``, most common first."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def config(self) -> ModelConfig:
        if self._config is None:
            arch = self.architecture
            if not isinstance(arch, str):
                raise WeightsError(f"general.architecture must be a string, got {arch!r}", file=self.path)
            if arch not in GGUF_ARCHITECTURES:
                raise WeightsError(
                    f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}",
                    file=self.path)
            rope = self.tensors.get("rope_freqs.weight")
            if rope is not None and math.prod(rope.shape) > MAX_HEAD_DIM // 2:
                # Converted before the config exists: bound it first (quantized data expands).
                raise WeightsError(f"shape {rope.shape}: a RoPE divisor table has at most {MAX_HEAD_DIM // 2} "
                                   f"entries (head_dim / 2)", file=self.path, tensor=rope.name)
            self._config = config_from_gguf(
                self.metadata,
                tie_word_embeddings="output.weight" not in self.tensors,
                rope_freqs=None if rope is None else self._convert(rope, np.dtype(np.float32)),
                attention_bias="blk.0.attn_q.bias" in self.tensors,
                mlp_bias="blk.0.ffn_up.bias" in self.tensors,
                source=str(self.path),
                rope_factors=self._rope_factors(),
            )
        return self._config

    def _rope_factors(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Phi-3's long-RoPE factor tensors (short, long), when the file has them."""
        short, long = self.tensors.get("rope_factors_short.weight"), self.tensors.get("rope_factors_long.weight")
        if short is None and long is None:
            return None
        if short is None or long is None:
            raise WeightsError("a long-RoPE file needs both rope_factors_short and rope_factors_long", file=self.path)
        for t in (short, long):
            if math.prod(t.shape) > MAX_HEAD_DIM // 2:
                raise WeightsError(f"shape {t.shape}: at most {MAX_HEAD_DIM // 2} RoPE factors", file=self.path,
                                   tensor=t.name)
        return self._convert(short, np.dtype(np.float32)), self._convert(long, np.dtype(np.float32))

    def check(self) -> dict[str, tuple[list[str], int]]:
        """Map GGUF names to HF names, checking names, shapes and types before any data
        is converted. Returns ``{gguf_name: (hf_names, how)}`` in file order (several
        names for a fused or stacked tensor, see :func:`_parts`)."""
        config = self.config()
        expected = config.weight_shapes()
        names: dict[str, tuple[list[str], int]] = {}
        for t in self.tensors.values():
            if t.name in _NOT_WEIGHTS:
                continue
            name = hf_name(t.name, config.model_type)
            parts, how = _parts(name, config) if name is not None else ([], 0)
            shape = _joined_shape(parts, how, expected) if parts else None
            if shape is None:
                raise WeightsError("unexpected tensor for this architecture/config", file=self.path, tensor=t.name)
            if t.shape != shape:
                raise WeightsError(f"shape {t.shape}, expected {shape} ({name})", file=self.path, tensor=t.name)
            _require_supported(t, self.path)
            names[t.name] = (parts, how)
        missing = sorted(set(expected) - {n for parts, _ in names.values() for n in parts})
        if missing:
            raise WeightsError(f"{len(missing)} tensor(s) missing", file=self.path, tensor=missing[0])
        return names

    def load_records(self, *, progress: Progress | None = None) -> dict[str, Weight]:
        """HF-named records in the file's own formats, memory-mapped, nothing converted:
        fused tensors split and stacked ones unstacked as row views, llama.cpp's Q/K row
        permutation undone as a strided view of whole block rows. Only Gemma's norms are
        new arrays (llama.cpp stores ``1 + weight``; small float32 vectors). Every
        record's values are checked finite (its f16 scales, for blocks) without widening."""
        names = self.check()
        config = self.config()
        expected = config.weight_shapes()
        permute = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
        out: dict[str, Weight] = {}
        total = len(names)
        for done, (gname, (parts, how)) in enumerate(names.items(), 1):
            record = self.record(self.tensors[gname])
            if config.norm_offset and gname.endswith("norm.weight"):
                shifted = record.to_float(np.float32) - np.float32(config.norm_offset)
                record = Weight.from_array(shifted, source=str(self.path), name=gname)
            for name, part in _split_record(record, parts, how, expected).items():
                if config.model_type in ("llama", "mixtral"):
                    for proj, heads in permute.items():
                        if f".{proj}." in name:
                            part = part.permute_rows(heads)
                out[name] = part
            if progress is not None:
                progress(done, total, parts[0])
        return out

    def load_weights(self, *, dtype: str | np.dtype = "float32", progress: Progress | None = None) -> dict[str, np.ndarray]:
        """HF-named float weights, one tensor converted at a time (see :meth:`load_records`)."""
        dt = np.dtype(dtype)
        if dt not in (np.float32, np.float16):
            raise ValueError(f"dtype must be float32 or float16, got {dt}")
        return {name: np.ascontiguousarray(w.to_float(dt))
                for name, w in self.load_records(progress=progress).items()}

    def record(self, t: GGUFTensor) -> Weight:
        """Tensor ``t`` as a record: a read-only view of the file's memory map, checked finite."""
        try:
            if self._map is None:
                # A plain ndarray view: results derived from an np.memmap keep its subclass.
                self._map = np.memmap(self.path, dtype=np.uint8, mode="r").view(np.ndarray)
        except (OSError, ValueError) as exc:
            raise WeightsError(f"cannot map tensor data: {exc}", file=self.path, tensor=t.name) from None
        mm = self._map[t.offset: t.offset + t.nbytes]
        if mm.size != t.nbytes:  # the file shrank after its header was read
            raise WeightsError(f"cannot map tensor data: the file holds {mm.size} of its {t.nbytes} bytes at offset "
                               f"{t.offset} (truncated?)", file=self.path, tensor=t.name)
        fmt = format_info(t.type_name)
        if fmt.is_float:
            data = mm.view(fmt.numpy).reshape(t.shape)
        else:
            data = mm.reshape(*t.shape[:-1], row_bytes(fmt, t.shape[-1]))
        record = Weight(fmt.name, t.shape, data, source=str(self.path), name=t.name)
        record.check_finite()
        return record

    def _convert(self, t: GGUFTensor, dtype: np.dtype) -> np.ndarray:
        return np.ascontiguousarray(self.record(t).to_float(dtype))


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF header (metadata and tensor table); WeightsError says what is wrong."""
    path = Path(path)
    try:
        with open_regular(path, what="GGUF file", error=lambda msg: WeightsError(msg, file=path)) as f:
            size = f.seek(0, 2)
            if size < 24:
                raise WeightsError(f"file is {size} bytes, too short for a GGUF header", file=path)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(path, buf, size)
    except OSError as exc:
        raise WeightsError(f"cannot read: {exc}", file=path) from None


# -- header parsing ---------------------------------------------------------------------


class _Cursor:
    """Reads the header, checking each length against the file's end and the limits."""

    def __init__(self, path: Path, buf: mmap.mmap, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0
        self.elements = 0  # array elements read so far, all arrays together

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise WeightsError(
                f"{what} at byte {self.pos} needs {n} bytes but the file ends at {self.size} (truncated or corrupt)",
                file=self.path,
            )

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str, limit: int = MAX_GGUF_STRING_BYTES) -> str:
        n = self.scalar("<Q", what)
        self.string_length(n, what, limit)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # Old converters wrote some vocab pieces as raw bytes; keep them visible, not fatal.
            return raw.decode("utf-8", errors="replace")

    def string_length(self, n: int, what: str, limit: int = MAX_GGUF_STRING_BYTES) -> None:
        if n > limit:
            raise WeightsError(f"{what}: a string of {n:,} bytes; at most {limit:,} are accepted (corrupt)", file=self.path)
        self.need(n, what)

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings in a row: :meth:`string`'s checks in one loop (a vocabulary
        holds 50-250 thousand of them and its parse is part of every load)."""
        buf, size, pos = self.buf, self.size, self.pos
        length = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, what)
            (n,) = length(buf, pos)
            pos += 8
            end = pos + n
            if n > MAX_GGUF_STRING_BYTES or end > size:
                self.pos = pos
                self.string_length(n, what)  # raises
            raw = buf[pos:end]
            pos = end
            try:
                append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                append(raw.decode("utf-8", errors="replace"))
        self.pos = pos
        return out

    def count(self, n: int, what: str) -> None:
        """Account for an array of ``n`` elements before any of it is read."""
        if n > MAX_GGUF_ARRAY:
            raise WeightsError(f"{what}: an array of {n:,} elements; at most {MAX_GGUF_ARRAY:,} are accepted "
                               f"(corrupt)", file=self.path)
        self.elements += n
        if self.elements > MAX_GGUF_ARRAY_TOTAL:
            raise WeightsError(f"{what}: the metadata arrays hold more than {MAX_GGUF_ARRAY_TOTAL:,} elements "
                               f"together (corrupt)", file=self.path)

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype], what)
        if vtype == 8:
            return self.string(what)
        if vtype == 9:
            if depth >= MAX_GGUF_NESTING:
                raise WeightsError(f"{what}: arrays nest more than {MAX_GGUF_NESTING} levels deep (corrupt)", file=self.path)
            etype = self.scalar("<I", what)
            count = self.scalar("<Q", what)
            self.count(count, what)
            if etype in _ARRAY_NUMPY:
                width = np.dtype(_ARRAY_NUMPY[etype]).itemsize
                self.need(count * width, what)
                arr = np.frombuffer(self.buf[self.pos : self.pos + count * width], dtype=_ARRAY_NUMPY[etype])
                self.pos += count * width
                return arr.astype(bool).tolist() if etype == 7 else arr.tolist()
            if etype == 8:
                self.need(8 * count, what)  # every string needs at least its 8-byte length
                return self.strings(count, what)
            if etype == 9:
                self.need(12 * count, what)  # every array needs at least its type and count
                return [self.value(9, what, depth + 1) for _ in range(count)]
            raise WeightsError(f"{what}: unknown array element type {etype} (corrupt)", file=self.path)
        raise WeightsError(f"{what}: unknown metadata value type {vtype} at byte {self.pos} (corrupt)", file=self.path)


def _parse(path: Path, buf: mmap.mmap, size: int) -> GGUFFile:
    if buf[:4] != _MAGIC:
        raise WeightsError(f"not a GGUF file (magic {bytes(buf[:4])!r}, expected {_MAGIC!r})", file=path)
    cur = _Cursor(path, buf, size)
    cur.pos = 4
    version = cur.scalar("<I", "version")
    if version not in (2, 3):
        raise WeightsError(f"GGUF version {version} is not supported (2 and 3 are)", file=path)
    n_tensors = cur.scalar("<Q", "tensor count")
    n_kv = cur.scalar("<Q", "metadata count")
    for n, what, limit in ((n_tensors, "tensor count", MAX_GGUF_TENSORS), (n_kv, "metadata count", MAX_GGUF_METADATA)):
        if n > limit:
            raise WeightsError(f"the header's {what} is {n:,}; at most {limit:,} are accepted (corrupt header)", file=path)
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}", MAX_GGUF_KEY_BYTES)
        if key in metadata:
            raise WeightsError(f"metadata key {key!r} appears twice; which value is meant is ambiguous (corrupt)",
                               file=path)
        metadata[key] = cur.value(cur.scalar("<I", f"type of {key!r}"), f"metadata {key!r}")
    infos = []
    for i in range(n_tensors):
        name = cur.string(f"tensor name #{i}", MAX_GGUF_KEY_BYTES)
        n_dims = cur.scalar("<I", f"tensor {name!r} dims")
        if not 1 <= n_dims <= MAX_TENSOR_DIMS:
            raise WeightsError(f"{n_dims} dimensions; 1 to {MAX_TENSOR_DIMS} are accepted (corrupt header)",
                               file=path, tensor=name)
        ne = [cur.scalar("<Q", f"tensor {name!r} shape") for _ in range(n_dims)]
        if math.prod(ne) > _ELEMENTS_PER_BYTE * size:
            raise WeightsError(f"dimensions {ne} describe more elements than a {size:,}-byte file can hold "
                               f"(corrupt header)", file=path, tensor=name)
        ggml_type = cur.scalar("<I", f"tensor {name!r} type")
        offset = cur.scalar("<Q", f"tensor {name!r} offset")
        infos.append((name, ne, ggml_type, offset))
    fields = Fields(metadata, str(path), error=WeightsError)
    alignment = fields.integer("general.alignment", _DEFAULT_ALIGNMENT)
    if not 1 <= alignment <= MAX_GGUF_ALIGNMENT or alignment & (alignment - 1):
        raise fields.fail("general.alignment", f"an integer power of two from 1 to {MAX_GGUF_ALIGNMENT:,}", alignment)
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, ne, ggml_type, offset in infos:
        nbytes = _nbytes(path, name, ne, ggml_type)
        if offset % alignment:
            raise WeightsError(f"data offset {offset} is not a multiple of general.alignment {alignment} (corrupt)",
                               file=path, tensor=name)
        start = data_start + offset
        if start + nbytes > size:
            raise WeightsError(
                f"data ends at byte {start + nbytes} but the file has {size} bytes (truncated)", file=path, tensor=name
            )
        if name in tensors:
            raise WeightsError("tensor name appears twice (corrupt header)", file=path, tensor=name)
        tensors[name] = GGUFTensor(name, tuple(int(d) for d in reversed(ne)), ggml_type, start, nbytes)
    return GGUFFile(path, version, metadata, tensors, data_start, size)


def _type_name(ggml_type: int) -> str:
    known = format_of_ggml(ggml_type)  # the formats polyengine reads itself: no gguf import at load
    if known is not None:
        return known.name
    import gguf

    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type#{ggml_type}"


def _nbytes(path: Path, name: str, ne: list[int], ggml_type: int) -> int:
    known = format_of_ggml(ggml_type)
    if known is not None:
        block, type_size = known.block, known.nbytes
    else:
        import gguf

        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise WeightsError(f"unknown ggml type {ggml_type} (corrupt header or newer format)", file=path,
                               tensor=name) from None
    if ne[0] % block:
        raise WeightsError(
            f"row length {ne[0]} is not a multiple of the {_type_name(ggml_type)} block size {block}", file=path, tensor=name
        )
    return math.prod(ne) // block * type_size


_supported_cache: dict[int, bool] = {}


def _dequantizable(ggml_type: int) -> bool:
    """Whether ``gguf.quants`` can dequantize this type (tried on one zero block)."""
    if ggml_type not in _supported_cache:
        import gguf

        qtype = gguf.GGMLQuantizationType(ggml_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
            _supported_cache[ggml_type] = block > 1
        except (NotImplementedError, ValueError):
            _supported_cache[ggml_type] = False
    return _supported_cache[ggml_type]


def _require_supported(t: GGUFTensor, path: Path) -> None:
    if t.ggml_type in _FLOAT_NUMPY or format_of_ggml(t.ggml_type) is not None or _dequantizable(t.ggml_type):
        return
    import gguf

    ok = sorted({_type_name(k) for k in _FLOAT_NUMPY} | {q.name for q in gguf.GGMLQuantizationType if _dequantizable(q)})
    raise WeightsError(
        f"quantization type {t.type_name} is not supported (the gguf package cannot dequantize it); "
        f"supported: {', '.join(ok)}",
        file=path,
        tensor=t.name,
    )
