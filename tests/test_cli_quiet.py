"""The CLI's conventions (a newcomer's first hour): ``python -m polyengine``, ``-q``,
a prompt from standard input with ``-``, no seed line under greedy, ``/exit`` in chat
and no ``you>`` prompt text when chat's input is piped."""

from __future__ import annotations

import subprocess
import sys

BASE = ["generate", "--model", "random:tiny", "--backend", "reference", "--raw", "--max-tokens", "3"]


def _run(args, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polyengine", *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


def test_python_dash_m_quiet_greedy_and_a_prompt_from_stdin():
    loud = _run([*BASE, "--temperature", "0", "hello"])
    assert loud.returncode == 0, loud.stderr
    assert "on reference (cpu (NumPy)), ready in" in loud.stderr
    assert not any(line.startswith("(seed") for line in loud.stderr.splitlines())  # greedy: no seed to report
    quiet = _run([*BASE, "--temperature", "0", "-q", "-"], stdin="hello")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == loud.stdout  # '-' read the same prompt from standard input
    assert quiet.stderr == "", quiet.stderr  # -q: errors only (not even the random-weights warning)
    sampled = _run([*BASE, "--temperature", "1", "--seed", "5", "hello"])
    assert "(seed 5)" in sampled.stderr.splitlines()


def test_chat_exits_on_slash_exit_and_prints_no_prompt_text_when_piped():
    proc = _run(["chat", "--model", "random:tiny", "--backend", "reference", "--max-tokens", "2", "-q"],
                stdin="/exit\nthis line is never read\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""  # no "you> ", and nothing was sent to the model


def test_backends_verbose_lists_each_backends_options():
    import json

    proc = _run(["backends", "--verbose", "--json"])
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    cpu = {o["name"]: o for o in rows["cpu"]["options"]}
    assert cpu["isa"]["default"] == "auto" and "avx2" in cpu["isa"]["choices"]
    assert {o["name"] for o in rows["cuda_torch"]["options"]} >= {"device", "cuda_graphs"}
    assert "quantize" in {o["name"] for o in rows["tpu_jax"]["options"]}
