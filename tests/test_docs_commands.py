"""Every command in README.md and docs/ runs as pasted.

What counts as a command (the rules this test applies, and the docs follow):

- Every line of a fenced block tagged ``bash``, ``sh``, ``shell`` or ``console`` that is
  not blank and not a comment is one command; a line ending in ``\\`` continues on the
  next; a leading ``$ `` prompt is dropped. A trailing ``# comment`` stays: bash ignores it.
  Untagged fences hold output or layouts, never commands.
- Each distinct command runs once, with bash, in a fresh temporary folder, this
  virtualenv's ``bin`` first on PATH (so ``polyengine``, ``python`` and ``pip`` are the
  installed ones), and must exit 0. ``curl`` to the documented server must also answer
  JSON without an ``error``.
- ``polyengine serve`` and ``python -m polyengine.serving`` run as servers: started with
  ``--port 0`` added (the documented port 8000 may be taken on a shared machine), the
  page's ``curl`` commands and the README's ``openai`` client block run against them with
  ``127.0.0.1:8000`` rewritten to the port they announced, then SIGTERM, after which
  they must exit 0.
- The ``python`` blocks of README.md run in order as one program (later blocks use
  names from earlier ones), the default model loaded once; the block that talks to a
  server runs against the README's ``polyengine serve``.
- A set-up line (``python3 -m venv .venv && .venv/bin/pip install ... && X``) runs X
  on this virtualenv: creating a venv and installing from PyPI is what this environment
  already is.
- Skipped, by the command's text, only with the reason written beside it in
  :data:`SKIPS`: hardware (GPU, TPU, Neuron), the network (installing from PyPI,
  AWS's index, building llama.cpp), long runs (benchmarks and the conformance suite:
  minutes each, run by their own tests), usage synopses and placeholders. An entry that
  matches no command fails the test, so the list cannot rot.

Slow (the default model loaded by seven commands, two of them servers): measured 181 s on
the shared two-core host at load average 5-7 (the README's Python blocks 73 s, the two
cpu.md generates 69 s); a failure lists every command with its time and the output's tail.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_TAGS = {"bash", "sh", "shell", "console"}
BIN = Path(sys.executable).parent
COMMAND_TIMEOUT_S = 300
DOCUMENTED_URL = "127.0.0.1:8000"

# (regex searched in the command, why it does not run here). Nothing else is skipped.
SKIPS: list[tuple[str, str]] = [
    (r"&& \.venv/bin/python -m pytest", "the whole test suite (31 minutes; this test is part of it)"),
    (r"^pip install|^CMAKE_ARGS=.* pip install|^pip download", "installs from PyPI or AWS's index (network); the "
                                                                "installed venv runs every other command"),
    (r"^cmake ", "builds llama.cpp from source (8 minutes on two cores, a download first)"),
    (r"--model [\w.-]+/[\w.:-]+|^polyengine pull ", "downloads from the Hugging Face Hub (network); tests/test_hub.py "
                                                  "runs these commands against a local stand-in of the Hub"),
    (r"^polyengine (backends|generate|chat|conformance|serve|bench|device-check|models|pull) \[|^polyengine generate PROMPT|"
     r"^polyengine conformance --backend NAME|--backend \w+\|\w+", "a usage synopsis: the brackets, bars and capitals "
                                                                  "are placeholders"),
    (r"--backend mybackend", "a placeholder backend name (a plugin the reader writes)"),
    (r"<the Q4_K_M file>|FILE\.gguf|--llamacpp-lib DIR|lcp/build/bin \.\.\.", "a placeholder for a file the reader made"),
    (r"--backend cuda_torch\b(?!.*--dry-run)", "needs a GPU"),
    (r"--backend neuron|torch-neuronx", "needs a Neuron device, or minutes of compiling on a CPU (tests/test_neuron_*.py)"),
    (r"--backend tpu_jax", "needs a TPU, or minutes of JAX compiling on a CPU (tests/test_tpu_jax*.py)"),
    (r"^polyengine conformance|^pytest --pyargs polyengine\.conformance",
     "the whole conformance suite: minutes (tests/test_conformance_cli.py runs it)"),
    (r"--dry-run", "every device-check step on the CPU: minutes (tests/test_device_check.py runs it)"),
    (r"^polyengine bench --quick$", "run as typed, output checked, by tests/test_bench_run.py::"
                                    "test_quick_bench_on_the_default_model (CI would pay for it twice)"),
    (r"^polyengine bench(?! --quick$)", "a benchmark: minutes to an hour (tests/test_bench_run.py runs its quick mode)"),
    (r"^python benchmarks/scripts/|^/usr/bin/time", "a benchmark script: minutes"),
    (r"--replicas", "starts a Ray cluster (tests/test_serving_ray.py)"),
]
# (after any VAR=value assignments of the environment it runs in)
SERVER = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(polyengine serve|python -m polyengine\.serving)\b")
# The README's set-up-and-run lines: the venv and installs are this environment; what follows them runs.
SETUP = re.compile(r"^python3 -m venv \.venv && (?:\.venv/bin/pip install [^&]+&& )+(?P<rest>.+)$")


def runnable(cmd: str) -> str:
    """The command as it runs here: a set-up line's tail, on this venv's ``bin``."""
    m = SETUP.match(cmd)
    return cmd if m is None else m.group("rest").replace(".venv/bin/", f"{BIN}/")


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """``(tag, line of the first body line, body lines)`` of every fenced block."""
    out, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        m = re.match(r"^\s*```(\S*)\s*$", lines[i])
        if m:
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith("```"):
                j += 1
            out.append((m.group(1), i + 2, lines[i + 1: j]))
            i = j
        i += 1
    return out


def shell_commands() -> list[Command]:
    out = []
    for page in PAGES:
        rel = str(page.relative_to(ROOT))
        for tag, first, body in _blocks(page):
            if tag not in SHELL_TAGS:
                continue
            pending, start = "", 0
            for k, line in enumerate(body):
                text = line.strip()
                if not pending and (not text or text.startswith("#")):
                    continue
                if not pending:
                    start = first + k
                    text = text[2:] if text.startswith("$ ") else text
                if text.endswith("\\"):
                    pending += text[:-1] + " "
                    continue
                if text.startswith("[") and out and out[-1].page == rel:  # a wrapped usage synopsis
                    out[-1] = Command(rel, out[-1].line, f"{out[-1].text} {text}")
                    continue
                out.append(Command(rel, start, pending + text))
                pending = ""
    return out


def code_of(cmd: str) -> str:
    """The command without its trailing comment (a ``#`` after a blank, outside quotes)."""
    quote = None
    for i, ch in enumerate(cmd):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or cmd[i - 1].isspace()):
            return cmd[:i].rstrip()
    return cmd.rstrip()


def readme_python() -> list[tuple[int, str]]:
    return [(first, "\n".join(body)) for tag, first, body in _blocks(ROOT / "README.md") if tag == "python"]


def skip_reason(cmd: str) -> str | None:
    for pattern, reason in SKIPS:
        if re.search(pattern, code_of(cmd)):
            return reason
    return None


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    return env


@dataclass
class Ran:
    where: str
    command: str
    seconds: float
    problem: str | None
    tail: str = ""


def _run(where: str, cmd: str, cwd: Path, *, check_json: bool = False) -> Ran:
    started = time.monotonic()
    try:
        p = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=_env(), capture_output=True, text=True,
                           timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Ran(where, cmd, time.monotonic() - started, f"ran past {COMMAND_TIMEOUT_S} s")
    seconds, tail = time.monotonic() - started, (p.stdout + p.stderr)[-1500:]
    problem = None if p.returncode == 0 else f"exit {p.returncode}"
    if problem is None and check_json:
        try:
            body = json.loads(p.stdout)
            if isinstance(body, dict) and "error" in body:
                problem = f"the server answered an error: {body['error']}"
        except ValueError:
            problem = "the answer is not JSON"
    return Ran(where, cmd, seconds, problem, tail)


class _Server:
    """A documented server command, on a free port, stopped with SIGTERM."""

    def __init__(self, cmd: str, cwd: Path):
        self.log = cwd / f"server-{time.monotonic_ns()}.log"
        # without its comment (a comment would swallow the port), through env (which takes
        # the VAR=value assignments that may lead it, where exec does not)
        self.proc = subprocess.Popen(["bash", "-c", f"exec env {code_of(cmd)} --port 0"], cwd=cwd, env=_env(),
                                     stdout=subprocess.DEVNULL, stderr=self.log.open("w"))
        self.address = self._wait()

    def _wait(self, timeout: float = 180.0) -> str | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            m = re.search(r"listening on http://(\S+)", self.log.read_text(errors="replace"))
            if m:
                return m.group(1)
            time.sleep(0.2)
        return None

    def stop(self) -> str | None:
        """None after a clean stop, else what went wrong."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return "did not stop within 60 s of SIGTERM"
        return None if rc == 0 else f"exit {rc} after SIGTERM"

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-1500:]


def test_every_skip_names_a_documented_command():
    texts = [code_of(c.text) for c in shell_commands()]
    stale = [pattern for pattern, _ in SKIPS if not any(re.search(pattern, t) for t in texts)]
    assert not stale, f"SKIPS entries that match no documented command (remove them): {stale}"


def test_the_docs_install_polyengine_from_a_clone_or_a_wheel_never_from_pypi():
    """polyengine is not on PyPI: a documented `pip install polyengine[...]` would fail."""
    bad = [c.where for c in shell_commands()
           if re.search(r"pip install\b.*(?<![\w./-])['\"]?polyengine(\[|['\"\s]|$)", code_of(c.text))]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    prose = ["README.md"] if re.search(r"pip install ['\"]?polyengine(\[[\w,]+\])?['\"]?[`\s]", readme) else []
    assert not bad and not prose, f"installs from PyPI, where polyengine is not: {bad + prose}"


@pytest.mark.slow
def test_documented_commands_run_as_pasted(tmp_path):
    began = time.monotonic()
    commands: dict[str, Command] = {}
    for c in shell_commands():
        commands.setdefault(code_of(c.text), c)  # one run per distinct command
    runs: list[Ran] = []
    servers = [c for t, c in commands.items() if SERVER.search(t) and skip_reason(t) is None]
    clients = [c for t, c in commands.items() if t.startswith("curl ") and DOCUMENTED_URL in t]
    for text, c in commands.items():
        if skip_reason(text) is None and c not in servers and c not in clients:
            runs.append(_run(c.where, runnable(text), tmp_path))

    blocks = readme_python()
    served = [(line, code) for line, code in blocks if "OpenAI(base_url=" in code]
    local = "\n\n".join(f"# README.md:{line}\n{code}" for line, code in blocks if (line, code) not in served)
    script = tmp_path / "readme_blocks.py"
    script.write_text(local, encoding="utf-8")
    runs.append(_run("README.md python blocks", f"python {script}", tmp_path))

    for server in servers:
        started = time.monotonic()
        s = _Server(server.text, tmp_path)
        if s.address is None:
            s.stop()
            runs.append(Ran(server.where, server.text, time.monotonic() - started, "never listened", s.tail()))
            continue
        if server.page == "README.md":
            for line, code in served:
                client = tmp_path / f"readme_client_{line}.py"
                client.write_text(code.replace(DOCUMENTED_URL, s.address), encoding="utf-8")
                runs.append(_run(f"README.md:{line} (against {server.where})", f"python {client}", tmp_path))
        for c in clients:
            if c.page == server.page:
                runs.append(_run(c.where, c.text.replace(DOCUMENTED_URL, s.address), tmp_path, check_json=True))
        problem = s.stop()
        runs.append(Ran(server.where, server.text, time.monotonic() - started, problem, s.tail() if problem else ""))

    ran_clients = {r.where for r in runs}
    orphans = [c.where for c in clients if c.where not in ran_clients]
    table = "\n".join(f"{r.seconds:7.1f} s  {'ok  ' if r.problem is None else 'FAIL'}  {r.where}  {r.command[:100]}"
                      for r in runs)
    failed = [r for r in runs if r.problem is not None]
    detail = "\n\n".join(f"{r.where}: {r.command}\n  {r.problem}\n{r.tail}" for r in failed)
    total = time.monotonic() - began  # a server's time includes its clients
    assert not failed and not orphans, (f"{len(failed)} documented command(s) failed; curl commands with no server "
                                        f"on their page: {orphans}\n{table}\n{total:.0f} s in all\n\n{detail}")
    print(f"\n{table}\n{total:.0f} s in all")
