"""polyengine and llama.cpp on one GGUF file, measured in alternation: one run of a phase
on each system in turn, round after round, so that every ratio is taken from two runs
seconds apart.

``polyengine bench`` runs its rows one after the other (all of one system's repeats, then
the next system's). On a host whose memory bandwidth drifts by tens of percent over
minutes (a shared cloud host: docs/benchmarks/2026-12-quantized.md, "Alternating runs"),
the ratio of two rows measured minutes apart then says as much about the drift as about
the systems. Here every system lives in its own worker process for the whole run (the
bench's own systems: ``polyengine.benchmarks.worker.build_system``, the same phases and
prompts as ``polyengine bench --workload scale``); a round runs one measured run of each
phase on each system, the first system of a round rotating, and the report is each
system's median and, against llama.cpp, the median of the per-round ratios with their
range. Only one worker computes at a time; the others wait on their pipe.

    python benchmarks/scripts/alternating.py --model FILE.gguf [--options JSON ...]
        [--threads 2] [--rounds 7] [--phases decode,prefill] [--batches 1,8] [--no-llamacpp]

Needs llama-cpp-python (``polyengine bench``'s llama.cpp peer), except with
``--no-llamacpp``: then the ratios are against the last ``--options`` row (two settings
of the cpu backend in alternation; any model ``polyengine bench`` takes). No peak RSS or
load time: engines rebuilt round after round are not what a user's process holds, and
``polyengine bench`` measures both.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import replace
from typing import Any


def _measure(system: Any, work: Any, phase: str, batch: int, warmup: bool) -> float:
    """One run (or a warm-up: other prompts, the same shapes) of ``phase``: decode tok/s at
    ``batch``, or prefill tok/s."""
    from polyengine.benchmarks.stats import rate
    from polyengine.benchmarks.workload import prompts

    vocab = system.vocab_size
    kind = "warmup" if warmup else phase
    if phase == "prefill":
        p = prompts(vocab, 1, work.prefill_len, phase=kind, seed=work.seed)[0]
        return rate(work.prefill_len, system.prefill(p))
    ps = prompts(vocab, batch, work.prompt_len, phase=kind, seed=work.seed)
    run = system.decode(ps, work.warmup_tokens if warmup else work.new_tokens, room=work.new_tokens)
    return rate(run.decode_tokens, run.decode_seconds)


def _worker(kind: str, params: dict[str, Any], work: dict[str, Any], conn: Any) -> None:
    """A system's process: build it, then answer each (phase, batch) request with the rate
    of one measured run after a warm-up; None ends it."""
    from polyengine.benchmarks.worker import build_system
    from polyengine.benchmarks.workload import Workload

    try:
        workload = Workload.from_dict(work)
        system = build_system(kind, params)
        conn.send(("ready", None))
        while True:
            msg = conn.recv()
            if msg is None:
                return
            phase, batch = msg
            # a system keeps one engine (context) of one shape, so the last round's other
            # phases replaced it: a warm-up on the rebuilt one first, as the bench's runs have
            _measure(system, workload, phase, batch, True)
            conn.send(("rate", _measure(system, workload, phase, batch, False)))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which stops the run
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


class _Peer:
    def __init__(self, ctx: Any, label: str, kind: str, params: dict[str, Any], work: dict[str, Any]):
        self.label = label
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(kind, params, work, child), daemon=True)
        self.proc.start()
        self.rates: dict[str, list[float]] = {}

    def ask(self, msg: Any) -> Any:
        self.conn.send(msg)
        return self.answer()

    def answer(self) -> Any:
        """The worker's next reply (a failure there stops the run, naming the system)."""
        what, value = self.conn.recv()
        if what == "error":
            raise SystemExit(f"{self.label}: {value}")
        return value


def _phases(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(label, phase, batch) for each measured run of a round."""
    out = []
    for phase in args.phases.split(","):
        if phase == "decode":
            out += [(f"decode b{b}", "decode", b) for b in (int(x) for x in args.batches.split(","))]
        elif phase == "prefill":
            out.append((f"prefill {args.prefill}", "prefill", 1))
        else:
            raise SystemExit(f"--phases: {phase!r} is neither decode nor prefill")
    return out


def _rounds(peers: list[_Peer], phases: list[tuple[str, str, int]], rounds: int) -> None:
    for r in range(rounds):
        order = peers[r % len(peers):] + peers[:r % len(peers)]
        for name, phase, b in phases:
            for p in order:
                p.rates.setdefault(name, []).append(p.ask((phase, b)))
        line = "; ".join(f"{n}: " + " / ".join(f"{p.rates[n][-1]:.1f}" for p in peers) for n, _, _ in phases)
        print(f"round {r + 1}/{rounds} ({' / '.join(p.label for p in peers)}): {line}", flush=True)


def _report(peers: list[_Peer], phases: list[tuple[str, str, int]]) -> None:
    peer = peers[-1]  # llama.cpp, or the last polyengine row
    print()
    print("| system | " + " | ".join(f"{n} tok/s" for n, _, _ in phases) + " |")
    print("| --- |" + " ---: |" * len(phases))
    for p in peers:
        cells = [f"{statistics.median(p.rates[n]):.1f}" for n, _, _ in phases]
        print(f"| {p.label} | " + " | ".join(cells) + " |")
    for p in peers[:-1]:
        cells = []
        for n, _, _ in phases:
            ratios = [a / b for a, b in zip(p.rates[n], peer.rates[n])]
            cells.append(f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
        print(f"| {p.label} / {peer.label}, median of the rounds' ratios (range) | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True,
                    help="a GGUF file (with --no-llamacpp, any model polyengine bench takes)")
    ap.add_argument("--options", action="append", default=None,
                    help="cpu backend options, JSON (repeatable: one polyengine row each; default {\"threads\": N})")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (and the default options')")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--phases", default="decode,prefill")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt", type=int, default=128, help="decode's prompt tokens (the scale workload's)")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode's new tokens a request")
    ap.add_argument("--prefill", type=int, default=512, help="the prefill phase's prompt tokens")
    ap.add_argument("--no-llamacpp", action="store_true", help="polyengine rows only, against the last one")
    args = ap.parse_args(argv)
    from polyengine.benchmarks.host import load_average
    from polyengine.benchmarks.workload import SCALE
    from polyengine.hostinfo import cpu_model

    phases = _phases(args)
    work = replace(SCALE, prompt_len=args.prompt, new_tokens=args.new_tokens, prefill_len=args.prefill).to_dict()
    options = [json.loads(o) for o in (args.options or [json.dumps({"threads": args.threads})])]
    if args.no_llamacpp and len(options) < 2:
        raise SystemExit("nothing to compare: give a second --options row, or leave out --no-llamacpp")
    ctx = mp.get_context("spawn")
    peers = [_Peer(ctx, f"polyengine cpu {json.dumps(o, sort_keys=True)}", "polyengine",
                   dict(model=args.model, backend="cpu", dtype=None, options=o), work) for o in options]
    if not args.no_llamacpp:
        peers.append(_Peer(ctx, f"llama.cpp, threads {args.threads}", "llamacpp",
                           dict(model=args.model, threads=args.threads, quant="the file's"), work))
    for p in peers:
        p.answer()  # built
    print(f"host: {cpu_model()}; load average {load_average()} with the systems built")
    print(f"model: {args.model}; {args.rounds} rounds, phases {', '.join(n for n, _, _ in phases)}", flush=True)
    start = time.perf_counter()
    _rounds(peers, phases, args.rounds)
    for p in peers:
        p.conn.send(None)
    _report(peers, phases)
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
