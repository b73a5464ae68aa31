"""benchmarks/scripts/serve_prefix.py (the paged prefix cache's serving measurement) runs
end to end: two servers (cache on, then off), its table, the warm requests' cache hits,
and outputs equal with the cache off. A tiny random model on the reference backend; the
numbers of record are the default model's (docs/prefix-caching.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scripts" / "serve_prefix.py"


def test_serve_prefix_script_measures_hits_and_compares_outputs(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--backend", "reference", "--model", "random:tiny",
                           "--prompts", "2", "--warm", "2", "--system-words", "20", "--max-tokens", "4",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| system prompt | request | prompt tokens | cached_tokens |" in proc.stdout
    assert "outputs equal to the server without the prefix cache: 6 of 6" in proc.stdout
    doc = json.loads(out.read_text())
    on, off = doc["on"], doc["off"]
    assert [r["request"] for r in on] == [0, 1, 2, 0, 1, 2]
    # every warm request shares its system prompt's full pages; the server without the cache shares nothing
    assert all(r["cached"] >= 16 for r in on if r["request"] > 0)
    assert all(r["cached"] == 0 for r in off)
    assert [r["text"] for r in on] == [r["text"] for r in off]
