"""F16 and F32 copies of a quantized GGUF, for llama.cpp's unquantized settings.

The copy keeps every metadata key (the vocabulary, the chat template, the shape keys)
except ``general.file_type``, which is set to what the copy now is. Tensors are
dequantized with ``gguf.quants`` one at a time and written in GGUF layout as they are:
llama.cpp's converter permuted the Q/K rows when the file was made and llama.cpp
expects them so, so nothing is un-permuted here (polyengine's loader un-permutes for
its HF-shaped weights; this file is for llama.cpp only). In the F16 copy the
one-dimensional tensors (norms, biases) stay F32, as llama.cpp's own converter does.

Copies live under the cache folder, keyed by the source's path, size and modification
time, and are written to a temporary name first, so a killed run leaves no half file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

__all__ = ["converted_gguf", "copy_path", "FILE_TYPES"]

# llama.cpp's LLAMA_FTYPE values for general.file_type.
FILE_TYPES = {"F32": 0, "F16": 1}


def _key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def copy_path(source: str | Path, kind: str, cache_dir: str | Path) -> Path:
    """Where the ``kind`` copy of ``source`` is (or will be) kept."""
    source = Path(source)
    return Path(cache_dir) / f"{source.stem}-{_key(source)}.{kind}.gguf"


def converted_gguf(source: str | Path, kind: str, cache_dir: str | Path) -> Path:
    """The cached ``kind`` ("F16" or "F32") copy of ``source``, written if missing."""
    if kind not in FILE_TYPES:
        raise ValueError(f"kind must be one of {sorted(FILE_TYPES)}, got {kind!r}")
    source = Path(source)
    dest = copy_path(source, kind, cache_dir)
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    try:
        _write(source, tmp, kind)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _write(source: Path, dest: Path, kind: str) -> None:
    import gguf

    reader = gguf.GGUFReader(source)
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    writer = gguf.GGUFWriter(dest, arch=arch_field.contents(), endianess=reader.endianess)
    alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = alignment.contents()
    for field in reader.fields.values():
        # GGUF.* are the reader's virtual fields; the writer writes the architecture itself.
        if field.name.startswith("GGUF.") or field.name == gguf.Keys.General.ARCHITECTURE:
            continue
        vtype = field.types[0]
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_key_value(field.name, FILE_TYPES[kind], vtype)
            continue
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    if reader.get_field(gguf.Keys.General.FILE_TYPE) is None:
        writer.add_file_type(FILE_TYPES[kind])

    def target(tensor: "gguf.ReaderTensor") -> type:
        flat = len(tensor.shape) == 1 or int(np.prod(tensor.shape[1:])) == 1
        return np.float32 if kind == "F32" or flat else np.float16

    shapes = []
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order: ne reversed
        dt = np.dtype(target(t))
        shapes.append(shape)
        writer.add_tensor_info(t.name, shape, dt, int(np.prod(shape)) * dt.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t, shape in zip(reader.tensors, shapes):
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        writer.write_tensor_data(np.ascontiguousarray(values.astype(target(t))))
    writer.close()
