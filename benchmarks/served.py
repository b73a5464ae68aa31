"""The ``served`` part: throughput and pace through HTTP servers, polyengine's against
llama.cpp's own ``llama-server`` on the same model, threads and slots.

Each system is a server started for the part and stopped after it: ``polyengine serve``
per polyengine row (its backend, dtype and options), and ``llama-server`` (found by
``--llama-server PATH``, ``$POLYENGINE_LLAMA_SERVER`` or on the PATH; built from the
llama.cpp source that llama-cpp-python ships, docs/benchmarks.md) on the same GGUF with
continuous batching, as many slots and the same threads. The load is the same for every
system: at each level of concurrent clients (default 1, 8 and 32), every client sends
``per_client`` streamed chat requests one after another, from a fixed mix of user turns,
greedy (or plain sampling at ``temperature``, seeded, no filters), ``ignore_eos``,
``new_tokens`` each. Measured by the client: completion tokens
per second of the level's wall time, time to first token, and the time between a
request's successive token chunks (every token its own chunk: ``logprobs`` is asked),
median and p99 over all the level's gaps. The part's targets (each level): polyengine's
tokens per second at least llama-server's, and its p99 time between tokens within 2x its
median.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["TURNS", "ServedSystem", "find_llama_server", "polyengine_command", "llama_server_command",
           "run_system", "verdicts"]

TURNS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one paragraph.",
    "Give me a tip for learning a new language.",
    "What is 12 times 7?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
)
STARTUP_SECONDS = 600.0


@dataclass
class ServedSystem:
    name: str  # "polyengine cpu default" or "llama-server"
    command: list[str]
    levels: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def find_llama_server(given: str | None) -> Path | None:
    """``--llama-server PATH``, else ``$POLYENGINE_LLAMA_SERVER``, else ``llama-server`` on
    the PATH; None when none is found (a given path that is not an executable file is an
    error, not a silent skip)."""
    from polyengine.errors import InvalidRequest

    for source, value in (("--llama-server", given), ("$POLYENGINE_LLAMA_SERVER", os.environ.get("POLYENGINE_LLAMA_SERVER"))):
        if value:
            path = Path(value).expanduser()
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise InvalidRequest(f"{source} {value!r} is not an executable file; build llama-server as "
                                     f"docs/benchmarks.md says (the served part) and give its path")
            return path
    found = shutil.which("llama-server")
    return Path(found) if found else None


def polyengine_command(*, backend: str, dtype: str | None, options: dict[str, Any], model: str | None, slots: int,
                       context: int) -> list[str]:
    cmd = [sys.executable, "-m", "polyengine.serving", "--host", "127.0.0.1", "--port", "0", "--backend", backend,
           "--max-slots", str(slots), "--max-queue", "1024", "--context-length", str(context), "--log-level", "warning"]
    if model:
        cmd += ["--model", model]
    if dtype:
        cmd += ["--dtype", dtype]
    for key, value in sorted(options.items()):
        cmd += ["--option", f"{key}={json.dumps(value)}"]  # read back as JSON by the serve command
    return cmd


def llama_server_command(binary: Path, *, model: Path, slots: int, context: int, threads: int) -> list[str]:
    # -c is the whole KV cache, shared by the slots (each gets context tokens); -cb: continuous batching.
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", "0", "-np", str(slots),
            "-c", str(slots * context), "-cb", "-t", str(threads), "-tb", str(threads), "--no-webui",
            "--log-disable"]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str, list[str]]:
    """Start a server and return it with its URL once ``/health`` answers 200.
    ``polyengine serve`` binds port 0 and announces its port on stderr; llama-server
    does not announce a port 0's choice, so it is given a free one."""
    import httpx

    announces = cmd[1:3] == ["-m", "polyengine.serving"]
    url = None
    if not announces:
        port = _free_port()
        cmd = [*cmd[:cmd.index("--port") + 1], str(port), *cmd[cmd.index("--port") + 2:]]
        url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    lines: list[str] = []
    if announces:
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
    # Keep draining stderr, or a chatty server would block on a full pipe.
    threading.Thread(target=lambda: [lines.append(x) for x in proc.stderr], daemon=True).start()
    deadline = time.monotonic() + STARTUP_SECONDS
    while url is not None and time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=10).status_code == 200:
                return proc, url, lines
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    _stop(proc)
    raise RuntimeError(f"the server did not start ({' '.join(cmd[:4])} ...): {''.join(lines[-20:])[-1500:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def sampling_body(temperature: float, seed: int) -> dict[str, Any]:
    """A request's sampling fields: greedy at temperature 0; else plain sampling at that
    temperature, seeded, with every filter off in the spelling both servers read (top_p
    1, and the extras top_k 0 and min_p 0, which llama-server otherwise defaults to 40 and
    0.05)."""
    if temperature == 0:
        return {"temperature": 0}
    return {"temperature": temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": seed}


async def _request(http: Any, model: str, turn: str, new_tokens: int, sampling: dict[str, Any]) -> dict[str, Any]:
    """One streamed request's times; a connection the server drops is a failed request."""
    import httpx

    try:
        return await _stream_request(http, model, turn, new_tokens, sampling)
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


async def _stream_request(http: Any, model: str, turn: str, new_tokens: int, sampling: dict[str, Any]) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": turn}], "max_tokens": new_tokens,
            **sampling, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "logprobs": True}
    t0 = time.perf_counter()
    times: list[float] = []
    tokens = None
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": str(chunk["error"])[:200]}
            if chunk.get("usage"):
                tokens = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if choice.get("logprobs") or delta.get("content"):
                    times.append(time.perf_counter())
    if not times:
        return {"error": "no tokens"}
    return {"ttft": times[0] - t0, "gaps": list(np.diff(times)), "tokens": tokens if tokens is not None else len(times)}


async def _level(url: str, model: str, clients: int, per_client: int, new_tokens: int,
                 temperature: float = 0.0) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    results: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        async def client(c: int) -> None:
            for i in range(per_client):
                n = c * per_client + i
                results.append(await _request(http, model, TURNS[n % len(TURNS)], new_tokens,
                                              sampling_body(temperature, n)))

        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    gaps = [g for r in ok for g in r["gaps"]]
    ttft = [r["ttft"] for r in ok]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    tokens = sum(r["tokens"] for r in ok)
    return {"clients": clients, "requests": len(ok), "errors": [r["error"] for r in results if "error" in r][:3],
            "failed": len(results) - len(ok), "seconds": wall, "tokens": tokens, "tok_s": tokens / wall,
            "ttft_p50_s": pct(ttft, 50), "itl_p50_s": pct(gaps, 50), "itl_p99_s": pct(gaps, 99),
            "tokens_per_request": sorted({r["tokens"] for r in ok})}


def run_system(system: ServedSystem, *, levels: tuple[int, ...], per_client: int, new_tokens: int,
               env: dict[str, str] | None = None, on_progress: Any = None, temperature: float = 0.0) -> ServedSystem:
    """Start ``system``'s server, warm it up (one short request), run every level, stop it."""
    try:
        proc, url, lines = _start(system.command, env or {})
    except Exception as exc:  # a server that cannot start loses its row, not the run
        system.error = f"{type(exc).__name__}: {exc}"
        return system
    try:
        import httpx

        info = httpx.get(url + "/v1/models", timeout=60).json()
        model = info["data"][0]["id"]
        for attempt in range(3):  # warm-up: first-call costs (a server just up may drop its first connection)
            warm = asyncio.run(_level(url, model, 1, 1, 4))
            if not warm["failed"]:
                break
            time.sleep(2)
        else:
            raise RuntimeError(f"the warm-up request failed 3 times: {warm['errors']}")
        for clients in levels:
            if on_progress:
                on_progress(f"{system.name}: {clients} client(s)")
            system.levels.append(asyncio.run(_level(url, model, clients, per_client, new_tokens, temperature)))
    except Exception as exc:
        tail = "".join(lines[-10:])[-800:]
        system.error = f"{type(exc).__name__}: {exc}" + (f"; the server's last output: {tail}" if tail else "")
    finally:
        _stop(proc)
    return system


def verdicts(systems: list[ServedSystem], *, peer: str = "llama-server", ratio: float = 1.0,
             pace: float = 2.0) -> list[dict[str, Any]]:
    """The part's targets for each polyengine system and level: tokens per second at
    least ``ratio`` x the peer's at the same level (not judged without a peer row), and
    the p99 time between tokens at most ``pace`` x its median."""
    peers = {lv["clients"]: lv for s in systems if s.name == peer and not s.error for lv in s.levels}
    out = []
    for s in systems:
        if s.name == peer or s.error:
            continue
        for lv in s.levels:
            c = lv["clients"]
            theirs = peers.get(c)
            if theirs is None or not theirs["tok_s"]:
                out.append({"system": s.name, "clients": c, "target": f"tok/s >= {ratio:g}x {peer}",
                            "passed": None, "why": f"not judged: no {peer} row at this level"})
            else:
                r = lv["tok_s"] / theirs["tok_s"]
                out.append({"system": s.name, "clients": c, "target": f"tok/s >= {ratio:g}x {peer}", "value": r,
                            "passed": r >= ratio and not lv["failed"]})
            if lv["itl_p50_s"]:
                r = lv["itl_p99_s"] / lv["itl_p50_s"]
                out.append({"system": s.name, "clients": c, "target": f"ITL p99 <= {pace:g}x p50", "value": r,
                            "passed": r <= pace})
    return out


def table(systems: list[ServedSystem], judged: list[dict[str, Any]]) -> str:
    """The part's Markdown table (one line per system and level) and its verdicts."""
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
    lines = ["| system | clients | requests (failed) | out tok/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms | p99/p50 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in systems:
        if s.error:
            lines.append(f"| {s.name} | - | error: {s.error[:160]} | | | | | |")
        for lv in s.levels:
            ratio = (f"{lv['itl_p99_s'] / lv['itl_p50_s']:.2f}" if lv["itl_p50_s"] else "-")
            lines.append(f"| {s.name} | {lv['clients']} | {lv['requests']} ({lv['failed']}) | {lv['tok_s']:.1f} | "
                         f"{ms(lv['ttft_p50_s'])} | {ms(lv['itl_p50_s'])} | {ms(lv['itl_p99_s'])} | {ratio} |")
    if judged:
        lines.append("")
    for v in judged:
        word = "not judged" if v["passed"] is None else ("PASS" if v["passed"] else "FAIL")
        value = f": {v['value']:.2f}" if "value" in v else f" ({v['why']})"
        lines.append(f"{word} {v['system']}, {v['clients']} client(s): {v['target']}{value}")
    return "\n".join(lines)


def model_for_peer(path: Path | None) -> Path | None:
    return path if path is not None and path.suffix.lower() == ".gguf" else None
