"""benchmarks/scripts/llama_shapes.py: the Llama-shaped files it writes, its cache and its table.

The quantizing and the bench themselves need llama-cpp-python and a quiet machine (not
CI): here the writer runs on a tiny shape with the real tokenizer, the quantize step is
checked to be skipped with a note without llama.cpp, and the table is built from canned
bench documents.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scripts" / "llama_shapes.py"


@pytest.fixture(scope="module")
def shapes():
    spec = importlib.util.spec_from_file_location("llama_shapes", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["llama_shapes"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("llama_shapes", None)


def _tiny(shapes, tied=False):
    return shapes.Shape("tiny", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, tied=tied)


def test_the_shapes_are_llamas(shapes):
    one, three, eight = (shapes.SHAPES[k] for k in ("1b", "3b", "8b"))
    assert (one.hidden, one.layers, one.heads, one.kv_heads, one.intermediate, one.tied) == (2048, 16, 32, 8, 8192, True)
    assert (three.hidden, three.layers, three.heads, three.kv_heads, three.intermediate, three.tied) == (
        3072, 28, 24, 8, 8192, True)
    assert (eight.hidden, eight.layers, eight.heads, eight.kv_heads, eight.intermediate, eight.tied) == (
        4096, 32, 32, 8, 14336, False)
    # with Llama 3's vocabulary the counts are Llama's own; with SmolLM2's, what the docstring says
    assert [round(s.parameters(128256) / 1e9, 2) for s in (one, three, eight)] == [1.24, 3.21, 8.03]
    assert [round(s.parameters(49152) / 1e9, 2) for s in (one, three, eight)] == [1.07, 2.97, 7.38]
    names = [n for n, _ in one.tensors(49152)]
    assert "output.weight" not in names and "output.weight" in [n for n, _ in eight.tensors(49152)]


def test_the_writer_makes_a_file_polyengine_loads(shapes, tmp_path, default_gguf):
    """Streamed F16 file with the default model's tokenizer: the shape, the formats (F16
    matrices, F32 norms), the values sane (std 0.02, norms 1)."""
    from polyengine.models import load_model

    shape = _tiny(shapes)
    path = shapes.write_f16(tmp_path / "tiny.gguf", shape, default_gguf)
    model = load_model(path)
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == (64, 2, 4, 2, 128, 49152, False)
    from polyengine.models.gguf_io import read_gguf

    same = [{k: v for k, v in read_gguf(p).metadata.items() if k.startswith("tokenizer.")} for p in (path, default_gguf)]
    assert same[0] == same[1]  # the default model's tokenizer, every key
    ids = model.tokenizer.encode("Hello world")
    assert len(ids) == 2 and model.tokenizer.decode(ids) == "Hello world"  # SmolLM2's BPE: two tokens
    rec = model.records
    assert rec["model.embed_tokens.weight"].format == "F16" and rec["model.embed_tokens.weight"].shape == (49152, 64)
    assert rec["lm_head.weight"].shape == (49152, 64)
    assert rec["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    assert rec["model.layers.1.mlp.down_proj.weight"].format == "F16"
    assert rec["model.layers.1.mlp.down_proj.weight"].shape == (64, 128)
    assert rec["model.norm.weight"].format == "F32"
    np.testing.assert_array_equal(model.weights["model.layers.0.input_layernorm.weight"], 1.0)
    assert np.std(model.weights["model.layers.0.mlp.up_proj.weight"]) == pytest.approx(0.02, rel=0.05)
    assert len(model.records) == 2 + 9 * 2 + 1  # embedding, head, 9 per layer, final norm


def test_without_llama_cpp_quantizing_is_skipped_with_a_note(shapes, tmp_path, default_gguf, monkeypatch):
    """No llama-cpp-python: the quantized formats are skipped with a note that says why and
    how to install it; F16 is still written, kept as a signed cache entry and reused."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    folder = shapes.cache_folder(tmp_path / "cache")
    notes: list[str] = []
    got = shapes.ensure_files([_tiny(shapes, tied=True)], ["Q4_K_M", "F16"], folder, notes, source=default_gguf)
    (note,) = notes
    assert "quantizing skipped (Q4_K_M)" in note and "llama-cpp-python is not installed" in note
    assert "pip install llama-cpp-python" in note
    assert [(e["shape"], e["format"]) for e in got] == [("tiny", "F16")]
    path = Path(got[0]["path"])
    stamp = path.stat().st_mtime_ns
    again = shapes.ensure_files([_tiny(shapes, tied=True)], ["F16"], folder, [], source=default_gguf)
    assert again == got and path.stat().st_mtime_ns == stamp  # verified and reused, not rewritten
    path.write_bytes(path.read_bytes()[:-1])  # a damaged entry is written again
    shapes.ensure_files([_tiny(shapes, tied=True)], ["F16"], folder, [], source=default_gguf)
    assert path.stat().st_size == got[0]["bytes"]
    assert sorted(p.name for p in folder.iterdir()) == sorted([path.name, path.name + ".json"])  # no F16 left behind


def _doc(pe: dict, lcp: dict | None, load_start=(0.2, 0.2, 0.2)):
    def row(kind, m):
        return {"row": f"{kind} x", "kind": kind, "errors": {}, "metrics": {
            "decode_tok_s": {"1": {"median": m["b1"]}, "8": {"median": m["b8"]}},
            "prefill_tok_s": {"median": m["prefill"]}, "peak_rss_mib": m["rss"], "load_s": m["load"]}}

    rows = [row("polyengine", pe)] + ([row("llamacpp", lcp)] if lcp else [])
    return {"started": "2026-12-03T18:00:00+00:00", "complete": True, "rows": rows, "notes": [],
            "targets": [], "host": {"cpu": {"model": "cpu", "cores": 2, "usable_cores": 2, "memory_gib": 24},
                                    "load_start": list(load_start), "load_end": [3.0, 3, 3], "versions": {}}}


def test_the_table_puts_both_systems_and_their_ratios_on_one_line(shapes):
    entries = [
        {"shape": "llama3.2-1b", "format": "Q4_K_M", "bytes": 669e6,
         "doc": _doc(dict(b1=17.3, b8=40.0, prefill=95.0, rss=1300.0, load=2.4),
                     dict(b1=34.6, b8=80.0, prefill=190.0, rss=1236.0, load=1.2))},
        {"shape": "llama3.2-1b", "format": "Q8_0", "bytes": 1100e6,
         "doc": _doc(dict(b1=8.0, b8=30.0, prefill=70.0, rss=4500.0, load=16.0), None, load_start=(1.5, 1, 1))},
    ]
    text = shapes.table(entries)
    head, sep, q4, q8 = text.splitlines()
    assert "llama.cpp b1 / b8 / prefill / RSS / load" in head and "ratio b1 / b8 / prefill / RSS / load" in head
    assert q4.startswith("| llama3.2-1b Q4_K_M | 669 ")
    assert "34.6 / 80.0 / 190 / 1236 / 1.2" in q4 and "17.3 / 40.0 / 95.0 / 1300 / 2.4" in q4
    assert "0.50x / 0.50x / 0.50x / 1.05x / 2.00x" in q4
    cells = [c.strip() for c in q8.split("|")[1:-1]]
    assert cells[2] == cells[4] == "- / - / - / - / -"  # no llama.cpp row: no peer values, no ratios
    assert cells[3] == "8.0 / 30.0 / 70.0 / 4500 / 16.0"
    full = shapes.summary(entries, threads=2, repeats=3)
    assert "WARNING: the machine was busy" in full and "median of 3 runs" in full
