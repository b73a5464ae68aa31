"""Shared system prompts through ``polyengine serve``: what the prefix cache gives the
second and later requests, measured as a client sees it.

    python benchmarks/scripts/serve_prefix.py [--backend cpu] [--model M] [--prompts 3] [--warm 3]
                                [--system-words 520] [--max-tokens 16] [--option KEY=VALUE ...] [--no-compare]
                                [--context-length N] [--startup SECONDS]

The measurement of the paged prefix cache's serving target: ``--prompts`` system prompts
of about 700 tokens each (``--system-words`` words of a fixed text, other words per
prompt); for each, one cold request (the system prompt and a user turn), then ``--warm``
requests with other user turns, one request at a time, streamed (greedy, ``ignore_eos``,
``logprobs`` so every token is a chunk of its own). Per request: the prompt's tokens,
``usage.prompt_tokens_details.cached_tokens``, and the time to first token from sending
the request. The targets: every warm request, the first after the cold one included,
reports ``cached_tokens`` >= 512 and a TTFT at most 0.2x the cold requests' median; and
the outputs equal those of a server without the prefix cache (``--prefix-cache-mib 0``,
the same requests in the same order, a second server started after the first stops;
``--no-compare`` skips it). Run it on an idle machine: the client shares the CPUs with
the server. Needs httpx (``pip install 'polyengine[test]'``).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import cpu_model, start_server  # noqa: E402

WORDS = ("system", "assistant", "policy", "answer", "careful", "customer", "order", "shipping", "refund", "account",
         "password", "security", "billing", "invoice", "product", "warranty", "support", "ticket", "priority",
         "escalate", "language", "polite", "concise", "summary", "detail", "example", "format", "markdown", "table",
         "history", "context", "document", "search", "result", "source", "citation", "date", "time", "region",
         "currency", "discount", "coupon", "delivery", "address", "contact", "email", "phone", "hours", "holiday")
TURNS = ("How do I reset my password?", "Where is my order?", "Can I get a refund for a broken item?",
         "What are your opening hours?", "How do I change my delivery address?", "Is there a discount for students?")


def system_prompt(index: int, words: int) -> str:
    rng = random.Random(1000 + index)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are support assistant number {index}. Follow these rules exactly: {body}."


def one(http: httpx.Client, model: str, system: str, user: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    t0 = time.perf_counter()
    first, text, usage = None, [], None
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise SystemExit(f"the server answered {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"the stream failed: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"]:
                delta = chunk["choices"][0]
                if delta.get("logprobs") and first is None:
                    first = time.perf_counter() - t0
                text.append(delta.get("delta", {}).get("content") or "")
    if first is None or usage is None:
        raise SystemExit("a request ended without tokens or usage")
    return {"ttft": first, "text": "".join(text), "prompt_tokens": usage["prompt_tokens"],
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def run_server(args, extra: tuple[str, ...]) -> list[dict]:
    proc, url = start_server(args, extra, startup=args.startup)
    try:
        with httpx.Client(base_url=url, timeout=3600) as http:
            model = http.get("/health", timeout=60).json()["model"]
            one(http, model, "You are brief.", "Say hi.", 2)  # warm-up: first-call costs, another prompt
            out = []
            for p in range(args.prompts):
                system = system_prompt(p, args.system_words)
                for i in range(args.warm + 1):
                    r = one(http, model, system, TURNS[(p + i) % len(TURNS)], args.max_tokens)
                    out.append({"prompt": p, "request": i, **r})
            return out
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--model", default=None, help="model for the server (default: the embedded one)")
    ap.add_argument("--prompts", type=int, default=3, help="system prompts (default 3)")
    ap.add_argument("--warm", type=int, default=3, help="requests after the cold one, per system prompt (default 3)")
    ap.add_argument("--system-words", type=int, default=520, help="words of each system prompt (default 520: ~700 tokens)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-slots", type=int, default=8)
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="an engine option of the server")
    ap.add_argument("--context-length", type=int, default=None, help="the server's --context-length (default: its own)")
    ap.add_argument("--startup", type=float, default=1800.0,
                    help="seconds a server may take to start (default 1800: tpu_jax with warmup=true compiles first)")
    ap.add_argument("--no-compare", action="store_true", help="skip the server without the prefix cache")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    extra = tuple(x for o in args.option for x in ("--option", o))
    if args.context_length:
        extra += ("--context-length", str(args.context_length))
    rows = run_server(args, extra)
    off = None if args.no_compare else run_server(args, (*extra, "--prefix-cache-mib", "0"))
    cold = [r["ttft"] for r in rows if r["request"] == 0]
    cold_p50 = statistics.median(cold)
    print(f"cpu: {cpu_model()}\nbackend {args.backend}, options {args.option or 'none'}; {args.prompts} system prompts, "
          f"1 cold + {args.warm} warm requests each, {args.max_tokens} tokens each, one request at a time\n")
    print("| system prompt | request | prompt tokens | cached_tokens | TTFT | TTFT / cold p50 |"
          + (" TTFT, cache off | same output, cache off |" if off else ""))
    print("| ---: | --- | ---: | ---: | ---: | ---: |" + (" ---: | --- |" if off else ""))
    for j, r in enumerate(rows):
        kind = "cold" if r["request"] == 0 else f"warm {r['request']}"
        line = f"| {r['prompt']} | {kind} "
        line += f"| {r['prompt_tokens']} | {r['cached']} | {r['ttft'] * 1000:.0f} ms | {r['ttft'] / cold_p50:.2f} |"
        if off:
            line += f" {off[j]['ttft'] * 1000:.0f} ms | {'yes' if off[j]['text'] == r['text'] else '**no**'} |"
        print(line)
    warm = [r for r in rows if r["request"] > 0]
    least = min(r["cached"] for r in warm)
    worst = max(r["ttft"] for r in warm) / cold_p50
    print(f"\nwarm requests: least cached_tokens {least} (target >= 512: {'met' if least >= 512 else 'not met'}); "
          f"worst TTFT / cold p50 {worst:.2f} (target <= 0.2: {'met' if worst <= 0.2 else 'not met'})")
    if off:
        same = sum(a["text"] == b["text"] for a, b in zip(rows, off))
        print(f"outputs equal to the server without the prefix cache: {same} of {len(rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"on": rows, "off": off}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
