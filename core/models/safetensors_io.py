"""Safetensors checkpoints to NumPy, without torch.

safetensors' own NumPy API cannot represent BF16 (NumPy has no such dtype), and most
real Llama/SmolLM2 checkpoints are BF16, so this module reads the format itself: an
8-byte little-endian header length, a JSON header (``dtype``, ``shape``,
``data_offsets`` per tensor), then the raw bytes. A BF16 value is the top half of a
float32, so widening is a 16-bit shift. F64, F32, F16 and BF16 are read.
:func:`load_safetensors_records` keeps each tensor in its own dtype as a memory-mapped
record (BF16 as its bit patterns); :func:`load_safetensors` widens to float32 (or
float16) arrays.

Decisions:
- Every header is read and checked against the config (names, shapes, byte ranges
  inside the file) before any tensor data is touched, so a bad checkpoint fails fast
  and the loader can refuse an oversized one before allocating.
- ``lm_head.weight`` in a checkpoint whose config ties embeddings is dropped unread,
  as transformers does (it re-ties the head to the embedding).
- ``rotary_emb.inv_freq`` buffers (old checkpoints) are ignored: RoPE comes from the config.
- A folder holds ``model.safetensors``, or shards listed by
  ``model.safetensors.index.json``, or exactly one other ``*.safetensors`` file.
  PyTorch ``.bin`` checkpoints are refused (they are pickles).
- Headers and the shard index are untrusted: the header's length is bounded before it
  is read, its JSON is depth-bounded with repeated names refused, every shape is a list
  of at most ``MAX_TENSOR_DIMS`` non-negative integers and every offset an integer; a
  shard name must be a file inside the model's folder (no absolute paths, no ``..``);
  errors never quote a file's bytes. Weights must be finite.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from polyengine.errors import WeightsError
from polyengine.files import open_regular
from polyengine.limits import MAX_JSON_DEPTH, MAX_SAFETENSORS_HEADER, MAX_TENSOR_DIMS
from polyengine.models.config import ModelConfig
from polyengine.models.blocks import narrow_bf16  # noqa: F401 - re-exported: the BF16 conversions live together
from polyengine.models.metadata import contained_file, json_depth, read_json, require_finite, shown

__all__ = [
    "SafetensorsEntry",
    "read_safetensors_header",
    "index_safetensors_folder",
    "load_safetensors",
    "load_safetensors_records",
    "select_entries",
    "widen_bf16",
    "narrow_bf16",
]

Progress = Callable[[int, int, str], None]

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}


@dataclass(frozen=True)
class SafetensorsEntry:
    """Where one tensor lives: ``begin``/``end`` are absolute byte offsets in ``file``."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_safetensors_header(path: str | Path) -> dict[str, SafetensorsEntry]:
    """Parse and validate one file's header; WeightsError names the file and tensor."""
    path = Path(path)
    try:
        with open_regular(path, what="safetensors file", error=lambda msg: WeightsError(msg, file=path)) as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"file is {size} bytes, too short for a safetensors header", file=path)
            n = int.from_bytes(head, "little")
            if n > min(MAX_SAFETENSORS_HEADER, size - 8):
                # The length is only quoted when it is plausible: otherwise it is just the
                # file's first eight bytes, and this may not be a safetensors file at all.
                claim = f"header claims {n:,} bytes but" if n <= MAX_SAFETENSORS_HEADER else "the header length is implausible:"
                raise WeightsError(
                    f"{claim} the file has {size - 8:,} bytes after the length field (truncated or not a "
                    "safetensors file)",
                    file=path,
                )
            raw = f.read(n)
    except OSError as exc:
        raise WeightsError(f"cannot read: {exc.strerror or exc}", file=path) from None
    header = _header_json(path, raw)
    data_start = 8 + n
    entries: dict[str, SafetensorsEntry] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _entry(path, name, spec)
        if dtype not in _ITEMSIZE:
            raise WeightsError(
                f"dtype {shown(dtype)} is not supported (supported: {', '.join(_ITEMSIZE)})", file=path, tensor=name
            )
        if not 0 <= begin <= end:
            raise WeightsError(f"bad offsets {(begin, end)}", file=path, tensor=name)
        if end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
            raise WeightsError(
                f"offsets {(begin, end)} hold {end - begin} bytes but {dtype}{list(shape)} needs "
                f"{math.prod(shape) * _ITEMSIZE[dtype]}",
                file=path,
                tensor=name,
            )
        if data_start + end > size:
            raise WeightsError(
                f"data ends at byte {data_start + end} but the file has {size} bytes (truncated)",
                file=path,
                tensor=name,
            )
        entries[name] = SafetensorsEntry(name, path, dtype, shape, data_start + begin, data_start + end)
    return entries


def _header_json(path: Path, raw: bytes) -> dict:
    def no_duplicates(pairs: list) -> dict:
        out = {}
        for key, value in pairs:
            if key in out:
                raise WeightsError(f"the header lists {shown(key)} twice; which entry is meant is ambiguous (corrupt)",
                                   file=path, tensor=key if isinstance(key, str) else None)
            out[key] = value
        return out

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except UnicodeDecodeError:
        raise WeightsError("header is not UTF-8 text; the file is corrupt or not safetensors", file=path) from None
    except RecursionError:
        raise WeightsError(f"header nests more than {MAX_JSON_DEPTH} levels; the file is corrupt", file=path) from None
    except json.JSONDecodeError as exc:
        raise WeightsError(f"header is not valid JSON ({exc.msg} at byte {exc.pos}); the file is corrupt",
                           file=path) from None
    if not isinstance(header, dict):
        raise WeightsError("header is not a JSON object; the file is corrupt", file=path)
    if json_depth(header, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise WeightsError(f"header nests more than {MAX_JSON_DEPTH} levels; the file is corrupt", file=path)
    return header


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(path: Path, name: str, spec: object) -> tuple[str, tuple[int, ...], int, int]:
    """One header entry's dtype, shape and offsets, each in the form the format defines."""
    form = ('{"dtype": "F32", "shape": [up to %d non-negative integers], "data_offsets": [begin, end]}'
            % MAX_TENSOR_DIMS)
    ok = isinstance(spec, dict) and isinstance(spec.get("dtype"), str)
    shape, offsets = (spec.get("shape"), spec.get("data_offsets")) if ok else (None, None)
    ok = ok and isinstance(shape, list) and len(shape) <= MAX_TENSOR_DIMS and all(_is_count(d) for d in shape)
    ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
    if not ok:
        raise WeightsError(f"malformed header entry {shown(spec)}; expected {form}", file=path, tensor=name)
    return spec["dtype"], tuple(shape), offsets[0], offsets[1]


def index_safetensors_folder(folder: str | Path) -> tuple[dict[str, SafetensorsEntry], Path]:
    """Every tensor of an HF folder's checkpoint, and the file that lists them
    (``model.safetensors`` or the shard index), for error messages."""
    folder = Path(folder)
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.exists():  # present but not a plain file is refused while reading, not ignored
        return read_safetensors_header(single), single
    if index.exists():
        weight_map = _weight_map(index)
        shards = {fname: contained_file(folder, fname, listing=index, key=f"weight_map[{name!r}]")
                  for name, fname in weight_map.items()}
        entries: dict[str, SafetensorsEntry] = {}
        for fname in sorted(set(weight_map.values())):
            shard = shards[fname]
            if not shard.exists():
                listed = next(k for k, v in weight_map.items() if v == fname)
                raise WeightsError(f"shard listed in {index.name} is missing", file=shard, tensor=listed)
            for name, entry in read_safetensors_header(shard).items():
                if name in entries:
                    raise WeightsError(f"tensor also stored in {entries[name].file.name}", file=shard, tensor=name)
                entries[name] = entry
        for name, fname in weight_map.items():
            if name not in entries:
                raise WeightsError(f"{index.name} places the tensor here but the shard lacks it", file=shards[fname], tensor=name)
        return entries, index
    others = sorted(folder.glob("*.safetensors"))
    if len(others) == 1:
        return read_safetensors_header(others[0]), others[0]
    if others:
        raise WeightsError(
            f"several .safetensors files ({', '.join(p.name for p in others)}) but no model.safetensors.index.json",
            file=folder,
        )
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise WeightsError(
            "only PyTorch pickle weights (.bin/.pt) found; polyengine does not unpickle. Convert with "
            "`model.save_pretrained(dir, safe_serialization=True)` in transformers",
            file=folder,
        )
    raise WeightsError("no model.safetensors or model.safetensors.index.json", file=folder)


def _weight_map(index: Path) -> dict[str, str]:
    """The shard index's ``weight_map``: tensor names to shard file names (checked later)."""
    data = read_json(index, error=WeightsError, what="shard index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
        raise WeightsError(f"the shard index must be an object whose weight_map maps tensor names to file names; "
                           f"got {shown(weight_map if isinstance(data, dict) else data)}", file=index)
    return weight_map


def widen_bf16(raw: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) to float32: a BF16 value is the top 16 bits of a float32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def _mapped(entries: dict[str, SafetensorsEntry], progress: Progress | None):
    """(name, entry, its bytes) for each entry in order: a read-only view of one memory
    map per file (nothing copied), the progress reported after each; an unreadable or
    truncated file is a WeightsError naming the tensor."""
    maps: dict[Path, np.ndarray] = {}
    for done, (name, entry) in enumerate(entries.items(), 1):
        if entry.file not in maps:
            try:
                # A plain ndarray view: arrays derived from an np.memmap keep its subclass.
                maps[entry.file] = np.memmap(entry.file, dtype=np.uint8, mode="r").view(np.ndarray)
            except OSError as exc:
                raise WeightsError(f"cannot read: {exc.strerror or exc}", file=entry.file, tensor=name) from None
        mm = maps[entry.file]
        if mm.shape[0] < entry.end:  # the file shrank after its header was read
            raise WeightsError("file is shorter than its header says (truncated)", file=entry.file, tensor=name)
        yield name, entry, mm[entry.begin: entry.end]
        if progress is not None:
            progress(done, len(entries), name)


def _read(entry: SafetensorsEntry, raw: np.ndarray, dtype: np.dtype) -> np.ndarray:
    raw = raw.view(_NUMPY[entry.dtype]).reshape(entry.shape)
    if entry.dtype == "BF16":
        out = widen_bf16(raw)
        return out if dtype == np.float32 else out.astype(dtype)
    return raw.astype(dtype)  # astype copies, so nothing keeps the file mapped


def _out_dtype(dtype: str | np.dtype) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in (np.float32, np.float16):
        raise ValueError(f"dtype must be float32 or float16, got {dt}")
    return dt


def load_safetensors_records(
    entries: dict[str, SafetensorsEntry], *, progress: Progress | None = None,
) -> dict[str, "Weight"]:
    """The given tensors as records in their own dtype (F32, F16, BF16), read-only views
    of each file's memory map, checked finite without widening; F64 (rare) is narrowed
    to an F32 record at load."""
    from polyengine.models.weights import Weight

    out: dict[str, Weight] = {}
    for name, entry, raw in _mapped(entries, progress):
        raw = raw.view(_NUMPY[entry.dtype]).reshape(entry.shape)
        if entry.dtype == "F64":
            record = Weight.from_array(require_finite(raw.astype(np.float32), file=entry.file, tensor=name),
                                       source=str(entry.file), name=name)
        else:
            record = Weight(entry.dtype, entry.shape, raw, source=str(entry.file), name=name)
        record.check_finite()
        out[name] = record
    return out


def load_safetensors(
    entries: dict[str, SafetensorsEntry],
    *,
    dtype: str | np.dtype = "float32",
    progress: Progress | None = None,
) -> dict[str, np.ndarray]:
    """Read the given tensors (one at a time, from a memory map of each file)."""
    dt = _out_dtype(dtype)
    return {name: require_finite(_read(entry, raw, dt), file=entry.file, tensor=name)
            for name, entry, raw in _mapped(entries, progress)}


_MIXTRAL = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def _renamed(name: str) -> str:
    """Mixtral's own names (``block_sparse_moe``, ``w1/w2/w3``) in the Qwen3-MoE spelling
    :meth:`ModelConfig.weight_shapes` uses."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    parts = name.split(".")
    if len(parts) >= 3 and parts[-2] in _MIXTRAL:
        parts[-2] = _MIXTRAL[parts[-2]]
    return ".".join(parts)


def _row_slices(entry: SafetensorsEntry, names: list[str], rows: list[int], listing: Path) -> dict[str, SafetensorsEntry]:
    """A fused ``[out, in]`` tensor's row blocks as entries of their own: rows of a
    row-major matrix are contiguous bytes, so each block is a byte range of the file."""
    if not entry.shape or entry.shape[0] != sum(rows):
        raise WeightsError(f"shape {entry.shape}: expected {sum(rows)} rows ({' + '.join(map(str, rows))})",
                           file=entry.file, tensor=entry.name)
    row_bytes = math.prod(entry.shape[1:]) * _ITEMSIZE[entry.dtype]
    out, begin = {}, entry.begin
    for name, n in zip(names, rows):
        out[name] = SafetensorsEntry(name, entry.file, entry.dtype, (n, *entry.shape[1:]), begin, begin + n * row_bytes)
        begin += n * row_bytes
    return out


def _canonical(entries: dict[str, SafetensorsEntry], config: ModelConfig, listing: Path) -> dict[str, SafetensorsEntry]:
    """The checkpoint's tensors under the names :meth:`ModelConfig.weight_shapes` uses:
    Mixtral's renamed, Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` split into their
    parts (as transformers' Phi-3 splits them: q, k, v rows; gate rows, then up)."""
    out: dict[str, SafetensorsEntry] = {}
    for name, entry in entries.items():
        name = _renamed(name)
        if name.endswith(".self_attn.qkv_proj.weight"):
            pre = name[: -len("qkv_proj.weight")]
            out.update(_row_slices(entry, [pre + f"{p}_proj.weight" for p in "qkv"],
                                   [config.q_size, config.kv_size, config.kv_size], listing))
        elif name.endswith(".mlp.gate_up_proj.weight"):
            pre = name[: -len("gate_up_proj.weight")]
            i = config.intermediate_size
            out.update(_row_slices(entry, [pre + "gate_proj.weight", pre + "up_proj.weight"], [i, i], listing))
        else:
            out[name] = entry if name == entry.name else SafetensorsEntry(name, entry.file, entry.dtype, entry.shape,
                                                                          entry.begin, entry.end)
    return out


def select_entries(
    entries: dict[str, SafetensorsEntry], config: ModelConfig, *, listing: Path
) -> dict[str, SafetensorsEntry]:
    """The entries the config needs, checked (missing, extra, shape) before any data is read."""
    entries = {
        k: v
        for k, v in _canonical(entries, config, listing).items()
        if not k.endswith("rotary_emb.inv_freq") and not (config.tie_word_embeddings and k == "lm_head.weight")
    }
    expected = config.weight_shapes()
    for name in expected:
        if name not in entries:
            raise WeightsError("tensor missing from the checkpoint", file=listing, tensor=name)
    for name, entry in entries.items():
        if name not in expected:
            raise WeightsError(
                "unexpected tensor for this config (wrong architecture or config.json?)", file=entry.file, tensor=name
            )
        if entry.shape != expected[name]:
            raise WeightsError(f"shape {entry.shape}, expected {expected[name]}", file=entry.file, tensor=name)
    return {name: entries[name] for name in expected}
