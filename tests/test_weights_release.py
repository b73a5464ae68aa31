"""A record's file pages leave the process once a copy of it is what is read
(``Weight.release_pages``, ``polyengine.models.weights.release_mapped``): a strided view of
a mapped file gives back the whole pages of its span and reads the same bytes after; a
conversion through ``Model.weight`` and the device paths' block forms (cuda_torch's stand-in,
tpu_jax) leave the file's mapping holding a small part of the file (before, the whole file
stayed resident beside the forms made from it). Resident bytes are read from
``/proc/self/smaps`` for the file's own mappings (Linux).
"""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from polyengine.models import ModelConfig, load_model
from polyengine.models.blocks import FLOAT_FORMATS
from polyengine.models.presets import random_weights
from polyengine.models.weights import Weight, release_mapped

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_DONTNEED) and smaps are Linux's")


def resident(path: Path) -> int:
    """Bytes of ``path``'s mappings resident in this process."""
    total, mine = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not line.startswith(("Rss", "Pss")):
            mine = line.rstrip().endswith(str(path))
        elif mine and line.startswith("Rss:"):
            total += int(head[1]) << 10
    return total


@linux
def test_a_strided_view_gives_back_its_pages_and_reads_the_same_bytes(tmp_path):
    path = tmp_path / "w.bin"
    data = np.random.default_rng(0).integers(0, 256, (512, 8192), dtype=np.uint8)  # 4 MiB
    data.tofile(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    rows = np.frombuffer(mm, dtype=np.uint8).reshape(data.shape)[::-1]  # permuted rows: negative strides
    assert int(rows.sum(dtype=np.int64)) > 0 and resident(path) >= data.nbytes  # every page read in
    assert Weight("F32", (data.size // 4,), np.frombuffer(mm, dtype=np.float32)).release_pages() >= data.nbytes - 4096
    assert resident(path) <= 4096  # the record's method: the same
    rows.sum(dtype=np.int64)  # read in again
    released = release_mapped(rows)
    assert released >= data.nbytes - 2 * mmap.PAGESIZE
    assert resident(path) <= 2 * mmap.PAGESIZE
    np.testing.assert_array_equal(rows, data[::-1])  # faulted back from the file
    assert release_mapped(data) == 0 and release_mapped(data[:0]) == 0  # not a file's map: nothing done


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    """A tiny Llama whose matrices are Q8_0 (1.1 MB of blocks), untied."""
    gguf = pytest.importorskip("gguf")
    from test_models_gguf import BYTE_TOKENS, write_gguf

    config = ModelConfig(vocab_size=len(BYTE_TOKENS), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
    weights = random_weights(config)
    path = tmp_path_factory.mktemp("release") / "q8.gguf"
    write_gguf(path, config, weights, types={n: gguf.GGMLQuantizationType.Q8_0 for n, a in weights.items()
                                            if a.ndim == 2})
    return path


def _matrices(model) -> list[str]:
    return [n for n, r in model.records.items() if r.format == "Q8_0" and n != "model.embed_tokens.weight"]


@linux
def test_a_conversion_gives_back_its_records_pages(q8_file):
    model = load_model(q8_file)  # the load reads every block's scale: the whole file is in
    names = _matrices(model)
    blocks = sum(model.records[n].nbytes for n in names)
    before = resident(q8_file)
    assert before >= blocks
    converted = {name: model.weight(name, FLOAT_FORMATS) for name in names}
    assert resident(q8_file) <= before - blocks + 4 * len(names) * mmap.PAGESIZE  # pages at the records' edges stay
    for name, w in converted.items():
        assert w.format == "F32"
        np.testing.assert_array_equal(w.data, model.records[name].to_float(np.float32))  # the record reads as before


@linux
@pytest.mark.parametrize("backend", ["cuda_torch", "tpu_jax", "neuron"])
def test_a_device_path_keeps_its_forms_not_the_file(q8_file, backend):
    """cuda_torch (its CPU stand-in) and tpu_jax make their block forms from the records,
    neuron float32 conversions (through the Model's float view), which then leave the
    process: the file's mapping keeps little more than the embedding table."""
    pytest.importorskip("jax" if backend == "tpu_jax" else "torch")
    import polyengine

    model = load_model(q8_file)
    names = _matrices(model)
    blocks = sum(model.records[n].nbytes for n in names)
    options = {"device": "cpu"} if backend == "cuda_torch" else {}
    eng = polyengine.create_engine(backend, model=model, config=dict(max_slots=1, max_cache_length=64,
                                                                       max_prefill_length=16, options=options))
    eng.load_params()
    embed = model.records["model.embed_tokens.weight"].nbytes
    assert resident(q8_file) <= embed + blocks // 4, (resident(q8_file), embed, blocks)
