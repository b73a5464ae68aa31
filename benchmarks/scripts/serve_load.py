"""Load test of ``polyengine serve``: requests/s, output tokens/s, time to first token and
inter-token latency at several numbers of concurrent clients.

    python benchmarks/scripts/serve_load.py [--backend auto] [--model M] [--clients 1 8 32]
                               [--requests-per-client 2] [--max-tokens 32] [--max-slots 8]
    python benchmarks/scripts/serve_load.py --url http://127.0.0.1:8000 --model-name NAME   # a running server

Without ``--url`` it starts ``python -m polyengine.serving --port 0`` itself (the
default model, ``--backend auto``: the fastest backend installed) and stops it with
SIGTERM at the end. Each client sends streamed chat requests one after another
(temperature 0, ``ignore_eos`` so every request makes exactly ``--max-tokens``
tokens, and ``logprobs`` so that every token arrives in a chunk of its own). Time to
first token is from sending the request to its first token's chunk; inter-token
latency is the gap between a request's successive token chunks.
Percentiles are over all requests of a level; the table's ``p50`` is the median.
Run it on an idle machine: the client shares the CPUs with the server (``--baseline``
adds the in-process driver's tokens/s for the same load, measured in the same run, and
the server's share of it). Needs httpx (``pip install 'polyengine[test]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np

from polyengine.benchmarks.served import TURNS as QUESTIONS  # the served part's fixed mix


def cpu_model() -> str:
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor() or platform.machine()
    name = re.search(r"model name\s*:\s*(.+)", info)
    flags = set(re.search(r"flags\s*:\s*(.+)", info).group(1).split()) if "flags" in info else set()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name.group(1).strip() if name else platform.machine()} x{os.cpu_count()} ({' '.join(isa) or 'no AVX2'})"


def start_server(args, extra: tuple[str, ...] = (), startup: float = 300.0) -> tuple[subprocess.Popen, str]:
    """``python -m polyengine.serving`` on a free port (``args``: backend, max_slots,
    model; ``extra``: more of its flags), given ``startup`` seconds to announce its port
    (a tpu_jax server with ``warmup=true`` compiles every program first); returns the
    process and its URL."""
    cmd = [sys.executable, "-m", "polyengine.serving", "--port", "0", "--backend", args.backend,
           "--max-slots", str(args.max_slots), "--max-queue", "1024", "--log-level", "warning", *extra]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + startup
    for line in proc.stderr:
        print(f"  server: {line.rstrip()}", file=sys.stderr)
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            # Keep draining stderr, or a chatty server would block on a full pipe.
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit("the server did not start")


async def one_request(http, model: str, question: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            # Log-probs make every token its own chunk, even one whose text is held back.
            "logprobs": True}
    t0 = time.perf_counter()
    times, tokens = [], 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"error": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"].get("code") or "stream"}
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["logprobs"]:
                times.append(time.perf_counter())
    if not times:
        return {"error": "no tokens"}
    return {"ttft": times[0] - t0, "itl": list(np.diff(times)), "tokens": tokens, "end": times[-1]}


async def level(url: str, model: str, clients: int, per_client: int, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    results: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        async def client(c: int) -> None:
            for i in range(per_client):
                q = QUESTIONS[(c * per_client + i) % len(QUESTIONS)]
                results.append(await one_request(http, model, q, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    itl = [g for r in ok for g in r["itl"]]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    return {
        "clients": clients, "requests": len(ok), "errors": len(results) - len(ok), "wall": wall,
        "req_s": len(ok) / wall, "tok_s": sum(r["tokens"] for r in ok) / wall,
        **{f"ttft_p{q}": pct(ttft, q) for q in (50, 90, 99)},
        **{f"itl_p{q}": pct(itl, q) for q in (50, 90, 99)},
    }


def driver_baseline(args, clients: int, per_client: int, slots: int) -> float:
    """Output tokens/s of the same requests through the in-process driver (no HTTP),
    ``clients`` kept in flight as the HTTP clients do: the server's overhead is the ratio."""
    from polyengine import LLM, SamplingParams

    llm = driver_baseline.llm = getattr(driver_baseline, "llm", None) or LLM(
        args.model, args.backend, max_slots=slots, max_queue=1024)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=True)
    todo = [llm.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
            for i in range(clients * per_client)]
    active, done = [], []
    t0 = time.perf_counter()
    while todo or active:
        while todo and len(active) < clients:
            active.append(llm.submit(todo.pop(0), sp))
        llm.step()
        done += [r for r in active if r.done]
        active = [r for r in active if not r.done]
    return sum(len(r.completion.token_ids) for r in done) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--model-name", default=None, help="the model id the running server serves")
    ap.add_argument("--model", default=None, help="model for the server this script starts (default: the embedded one)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--max-slots", type=int, default=8)
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--baseline", action="store_true",
                    help="also run the same load through the in-process driver (same run, same machine) and "
                         "print the server's share of its throughput")
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        info = httpx.get(url + "/health", timeout=60).json()
        model = args.model_name or info["model"]
        asyncio.run(level(url, model, 1, 1, 4))  # warm-up
        print(f"cpu: {cpu_model()}")
        print(f"server: {url}, model {model!r}, backend {info['backend']}, {args.max_slots} slots; "
              f"{args.max_tokens} tokens per request, {args.requests_per_client} requests per client\n")
        head = ("clients", "requests", "errors", "req/s", "out tok/s", "TTFT p50", "TTFT p90", "TTFT p99",
                "ITL p50", "ITL p90", "ITL p99") + (("driver tok/s", "server/driver") if args.baseline else ())
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("-" * (len(h) + 2) for h in head) + "|")
        for c in args.clients:
            r = asyncio.run(level(url, model, c, args.requests_per_client, args.max_tokens))
            ms = lambda v: f"{v * 1000:.0f} ms"  # noqa: E731
            row = (str(c), str(r["requests"]), str(r["errors"]), f"{r['req_s']:.2f}", f"{r['tok_s']:.1f}",
                   ms(r["ttft_p50"]), ms(r["ttft_p90"]), ms(r["ttft_p99"]),
                   ms(r["itl_p50"]), ms(r["itl_p90"]), ms(r["itl_p99"]))
            if args.baseline:
                base = driver_baseline(args, c, args.requests_per_client, args.max_slots)
                row += (f"{base:.1f}", f"{r['tok_s'] / base:.2f}")
            print("| " + " | ".join(v.rjust(len(h)) for v, h in zip(row, head)) + " |", flush=True)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)


if __name__ == "__main__":
    main()
