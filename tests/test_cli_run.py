"""`polyengine generate` and `polyengine chat` on a tiny random model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from polyengine.cli import main


def test_generate_json_fields(capsys):
    assert main(["generate", "--model", "random:tiny", "--json", "--temperature", "0", "--max-tokens", "5", "hello"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert set(out) == {"text", "token_ids", "finish_reason", "usage", "seed"}
    assert out["finish_reason"] in ("stop", "length") and 1 <= len(out["token_ids"]) <= 5
    assert out["usage"]["completion_tokens"] == len(out["token_ids"])
    assert "RANDOM" in captured.err  # random weights are announced


def test_generate_streams_and_is_reproducible_with_a_seed(capsys):
    args = ["generate", "--model", "random:tiny", "--seed", "11", "--max-tokens", "8", "--raw", "abc"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first
    assert main(args[:-1] + ["--json", "abc"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] + "\n" == first


def test_bad_flags_are_reported_not_raised(capsys):
    assert main(["generate", "--model", "random:tiny", "--temperature", "-1", "x"]) == 1
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "--model", "random:no-such-preset", "x"]) == 1
    assert "no-such-preset" in capsys.readouterr().err


def test_chat_keeps_history_resets_and_quits_on_eof():
    proc = subprocess.run(
        [sys.executable, "-m", "polyengine.cli", "chat", "--model", "random:tiny", "--temperature", "0",
         "--max-tokens", "4"],
        input="hello\nagain\n/reset\nhi\n", capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("assistant> ") == 3
    assert "(history cleared)" in proc.stderr


def test_unknown_backend_is_reported_before_loading_weights(capsys):
    assert main(["generate", "--backend", "nosuch", "x"]) == 1
    err = capsys.readouterr().err
    assert "no backend named 'nosuch'" in err and "loading weights" not in err


def test_generate_says_which_speed_paths_run(capsys):
    """The stderr lines under "backend:" are the engine's speed_paths (the reference
    backend's one path here; cuda_torch's kernels and int8 paths where it runs)."""
    assert main(["generate", "--model", "random:tiny", "--backend", "reference", "--max-tokens", "2", "-v", "hi"]) == 0
    err = capsys.readouterr().err
    assert "backend: reference\n  device: cpu (NumPy)\n" in err  # no speed_paths(): its device
