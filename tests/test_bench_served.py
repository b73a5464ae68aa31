"""The bench's served part (polyengine.benchmarks.served): HTTP servers under concurrent
clients, polyengine serve against llama-server. A tiny random model on the reference
backend, and a stand-in llama-server (tests/fake_llama_server.py) for the peer's path;
the numbers of record are the default model's on an idle host (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from polyengine.benchmarks import served
from polyengine.errors import InvalidRequest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
FAKE = Path(__file__).resolve().with_name("fake_llama_server.py")


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("polyengine")
    return [str(script)] if script.exists() else [sys.executable, "-m", "polyengine.cli"]


def test_served_part_runs_polyengine_serve_and_the_peer_at_each_level(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([*_cli(), "bench", "--parts", "served", "--backend", "reference", "--model", "random:tiny",
                           "--peers", "none", "--served-clients", "1,3", "--served-tokens", "5", "--served-requests", "2",
                           "--llama-server", str(FAKE), "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    sv = doc["served"]
    assert sv["levels"] == [1, 3] and sv["slots"] == 3 and sv["new_tokens"] == 5
    ours = sv["systems"][0]
    assert ours["name"] == "polyengine reference default" and ours["error"] is None
    assert "--max-slots" in ours["command"] and ours["command"][ours["command"].index("--max-slots") + 1] == "3"
    for level, clients in zip(ours["levels"], (1, 3)):
        assert level["clients"] == clients and level["requests"] == 2 * clients and level["failed"] == 0
        assert level["tokens_per_request"] == [5] and level["tok_s"] > 0
    # random:tiny is no GGUF file: the peer is not run, and a note says why
    assert [s["name"] for s in sv["systems"]] == ["polyengine reference default"]
    assert any("llama-server: not run, it needs a .gguf file" in n for n in doc["notes"])
    assert "HTTP servers (served part)" in proc.stdout and "| polyengine reference default | 3 | 6 (0) |" in proc.stdout


def test_the_peer_row_and_the_ratio_verdicts(tmp_path):
    """The peer's path through a stand-in llama-server: a port chosen for it, /health
    polled, the same load; then the verdicts compare levels."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    cmd = served.llama_server_command(FAKE, model=model, slots=2, context=64, threads=2)
    assert cmd[cmd.index("-np") + 1] == "2" and cmd[cmd.index("-c") + 1] == "128" and cmd[cmd.index("-t") + 1] == "2"
    peer = served.run_system(served.ServedSystem("llama-server", cmd), levels=(1, 2), per_client=2, new_tokens=6)
    assert peer.error is None, peer.error
    assert [lv["requests"] for lv in peer.levels] == [2, 4] and peer.levels[0]["tokens_per_request"] == [6]
    ours = served.ServedSystem("polyengine x", [], levels=[
        {**peer.levels[0], "tok_s": peer.levels[0]["tok_s"] * 1.5, "itl_p50_s": 0.01, "itl_p99_s": 0.03},
        {**peer.levels[1], "tok_s": peer.levels[1]["tok_s"] * 0.5, "itl_p50_s": 0.01, "itl_p99_s": 0.015}])
    judged = served.verdicts([ours, peer])
    by = {(v["clients"], v["target"].split()[0]): v for v in judged}
    assert by[(1, "tok/s")]["passed"] and by[(1, "tok/s")]["value"] == pytest.approx(1.5)
    assert not by[(2, "tok/s")]["passed"] and by[(2, "tok/s")]["value"] == pytest.approx(0.5)
    assert not by[(1, "ITL")]["passed"] and by[(2, "ITL")]["passed"]  # 3x and 1.5x their medians
    text = served.table([ours, peer], judged)
    assert "PASS polyengine x, 1 client(s): tok/s >= 1x llama-server: 1.50" in text
    assert "FAIL polyengine x, 2 client(s): tok/s >= 1x llama-server: 0.50" in text


def test_a_server_that_cannot_start_loses_its_row_not_the_run(tmp_path):
    bad = served.ServedSystem("llama-server", [sys.executable, "-c", "import sys; sys.exit(3)", "--port", "0"])
    assert served.run_system(bad, levels=(1,), per_client=1, new_tokens=2).error.startswith("RuntimeError: the server did not start")


def test_finding_llama_server(tmp_path, monkeypatch):
    monkeypatch.delenv("POLYENGINE_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert served.find_llama_server(None) is None
    with pytest.raises(InvalidRequest, match="is not an executable file"):
        served.find_llama_server(str(tmp_path / "nope"))
    monkeypatch.setenv("POLYENGINE_LLAMA_SERVER", str(FAKE))
    assert served.find_llama_server(None) == FAKE
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.delenv("POLYENGINE_LLAMA_SERVER")
    assert served.find_llama_server(None) == exe


def test_bad_served_arguments_are_refused(tmp_path):
    proc = subprocess.run([*_cli(), "bench", "--parts", "served", "--backend", "reference", "--model", "random:tiny",
                           "--peers", "none", "--served-clients", "0,2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--served-clients takes positive client counts" in proc.stdout + proc.stderr


def test_served_requests_can_sample(tmp_path):
    """--served-temperature: plain sampling, seeded, every filter off in both servers'
    spelling; the report says how the tokens were chosen; a bad value is refused."""
    assert served.sampling_body(0.0, 3) == {"temperature": 0}
    assert served.sampling_body(0.8, 3) == {"temperature": 0.8, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": 3}
    out = tmp_path / "bench.json"
    proc = subprocess.run([*_cli(), "bench", "--parts", "served", "--backend", "reference", "--model", "random:tiny",
                           "--peers", "none", "--served-clients", "2", "--served-tokens", "4", "--served-requests", "1",
                           "--served-temperature", "0.8", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sv = json.loads(out.read_text())["served"]
    assert sv["temperature"] == 0.8
    level = sv["systems"][0]["levels"][0]
    assert level["failed"] == 0 and level["tokens_per_request"] == [4], level
    assert "sampled at temperature 0.8, seeded, no filters" in proc.stdout
    bad = subprocess.run([*_cli(), "bench", "--parts", "served", "--backend", "reference", "--model", "random:tiny",
                          "--peers", "none", "--served-temperature", "-1"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--served-temperature -1.0 is outside [0, 100]" in bad.stdout + bad.stderr
