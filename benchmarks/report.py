"""The report: the host header, one table row per system and setting, the targets, the JSON.

A row's metrics are the medians of its runs (``phases``); the JSON keeps every sample
and its spread. The targets are issue 27's (CPU speed round two), judged in this run
against the best value any setting of the named peer reached here (transformers fp32
or bf16; llama.cpp Q4_1 as shipped, F16 or F32 at any thread count), so a target is
never met by comparing with a peer's weak setting:

- float32 decode b1 >= 80% of the bandwidth floor (or 3x transformers, the lower);
- int8 decode b1 >= llama.cpp Q4_1 (the GGUF as shipped);
- best decode b32 >= llama.cpp F16, and >= 2x transformers (capped at 80% of the
  host's torch float32 GEMM rate);
- best prefill 1024 >= transformers' best dtype;
- lowest peak RSS of the standard workload <= transformers' lowest.

(b1, b32 and 1024 are the workload's smallest and largest batch and its prefill length.)

Which polyengine rows a target judges: the float32 target every row that streams
float32 weights (engine dtype float32, no int8 option, no ``weight_dtype`` other than
"auto"/"float32": a bfloat16-weights row computes in float32 but streams half the
bytes); the int8 target every row whose options mention int8 in a key or value (e.g.
``{"weights": "int8"}``), one verdict per row. The "best"/"lowest" targets give one
verdict, for the polyengine row with the best value of all (any dtype or option set),
and name the rows it was chosen from (``best_of``).

A target with a host limit (benchmarks/limits.py) asks for at most ``CAP`` (80%) of
it: the smaller of threshold x the peer and 80% of the limit; the float32 b1 target
asks for 80% of the bandwidth floor alone when no transformers row ran. The floor a row
is judged by (and its "of host limits" share) comes from the memory reads probed right
before and after that row (``limits.for_row``), not from the one before all jobs.

The prefix part's targets (issue 23) are ratios within one row, measured in the same
worker: TTFT with the prefix cache over TTFT without, the chunked run's p99 inter-token
latency over its median, serve throughput with the cache over without.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from polyengine.benchmarks.limits import CAP, for_row
from polyengine.benchmarks.stats import MIB
from polyengine.benchmarks.workload import Workload

__all__ = ["SCHEMA", "Target", "SelfTarget", "SELF_TARGETS", "targets", "judge", "render", "write_json", "is_int8",
           "isa", "reached"]

SCHEMA = "polyengine-bench/1"


def is_int8(options: dict[str, Any]) -> bool:
    return any("int8" in str(k).lower() or "int8" in str(v).lower() for k, v in (options or {}).items())


def _dtype(row: dict[str, Any]) -> str | None:
    return (row.get("details") or {}).get("dtype") or (row.get("params") or {}).get("dtype")


def _float32(row: dict[str, Any]) -> bool:
    """A row that streams float32 weights: float32 engine, no int8 option, and no
    narrower ``weight_dtype`` (bfloat16 weights under float32 compute are not float32)."""
    options = (row.get("params") or {}).get("options") or {}
    weights = str(options.get("weight_dtype", "auto")).lower()
    return _dtype(row) == "float32" and not is_int8(options) and weights in ("auto", "float32")


def _int8(row: dict[str, Any]) -> bool:
    return is_int8((row.get("params") or {}).get("options", {}))


def _quant(name: str) -> Callable[[dict[str, Any]], bool]:
    return lambda row: (row.get("params") or {}).get("quant") == name


def _every(row: dict[str, Any]) -> bool:
    return True


@dataclass(frozen=True)
class Target:
    """A polyengine row's ``metric`` against the best value any setting of ``peer``
    reached in this run (the highest, or the lowest when ``lower_is_better``).

    What it asks (``needed``): ``threshold`` x that peer value, the least a row must
    reach (the most it may reach when ``lower_is_better``). With a host ``limit`` (a
    benchmarks/limits.py key in tok/s, for higher-is-better targets) the ask is the
    smaller of that and ``CAP`` (80%) x the limit, so a target never asks for more than
    the host allows; with ``limit_alone`` the 80% is asked on its own when no peer row
    has a value. ``best_only``: one verdict, for the polyengine row with the best value
    among those it applies to, rather than one per row."""

    name: str
    metric: tuple[str, ...]  # path into a row's metrics
    applies: Callable[[dict[str, Any]], bool]  # which polyengine rows it judges
    peer: str  # system kind the row is compared with
    peer_rows: Callable[[dict[str, Any]], bool]  # which of that peer's rows count
    threshold: float  # a multiple of the peer's best value
    limit: str | None = None  # a host limit that caps what is asked at CAP x it
    limit_alone: bool = False  # without a peer value, ask CAP x the limit alone
    best_only: bool = False  # judge only the polyengine row with the best value
    lower_is_better: bool = False  # passed at or below what is asked; "best" is the lowest


def targets(work: Workload) -> list[Target]:
    """Issue 27's targets (CPU speed round two), sized to the workload that ran."""
    b1, bmax, plen = str(min(work.batches)), str(max(work.batches)), work.prefill_len
    return [
        Target(f"float32 decode b{b1} >= 80% of the bandwidth floor (or 3x transformers, the lower)",
               ("decode_tok_s", b1), _float32, "transformers", _every, 3.0, limit="fp32_b1_floor_tok_s",
               limit_alone=True),
        Target(f"int8 decode b{b1} >= llama.cpp Q4_1", ("decode_tok_s", b1), _int8, "llamacpp", _quant("Q4_1"), 1.0),
        Target(f"best decode b{bmax} >= llama.cpp F16", ("decode_tok_s", bmax), _every, "llamacpp", _quant("F16"), 1.0,
               best_only=True),
        Target(f"best decode b{bmax} >= 2x transformers", ("decode_tok_s", bmax), _every, "transformers", _every, 2.0,
               limit="fp32_gemm_tok_s", best_only=True),
        Target(f"best prefill {plen} >= transformers' best", ("prefill_tok_s",), _every, "transformers", _every, 1.0,
               best_only=True),
        Target("lowest peak RSS <= transformers' lowest", ("peak_rss_mib",), _every, "transformers", _every, 1.0,
               best_only=True, lower_is_better=True),
    ]


@dataclass(frozen=True)
class SelfTarget:
    """A ratio of two metrics of one polyengine row: ``metric / base`` at most (or at
    least) ``threshold``."""

    name: str
    metric: tuple[str, ...]
    base: tuple[str, ...]
    threshold: float
    at_most: bool = True


SELF_TARGETS = (
    SelfTarget("shared prefix TTFT p50 with the cache <= 1/5 without", ("prefix_shared_ttft_p50_s", "cache"),
               ("prefix_shared_ttft_p50_s", "no_cache"), 0.2),
    SelfTarget("shared prefix TTFT p90 with the cache <= 1/5 without", ("prefix_shared_ttft_p90_s", "cache"),
               ("prefix_shared_ttft_p90_s", "no_cache"), 0.2),
    SelfTarget("long prompt under load, chunked: ITL p99 <= 3x median", ("prefix_loaded_itl_s", "chunked", "p99"),
               ("prefix_loaded_itl_s", "chunked", "median"), 3.0),
    SelfTarget("long prompt under load, chunked: ITL p99 <= 3x the streams' pace before it arrived",
               ("prefix_loaded_itl_s", "chunked", "p99"), ("prefix_loaded_itl_s", "chunked", "before"), 3.0),
    SelfTarget("serve throughput with the cache >= 0.95x without (unchanged within noise)",
               ("prefix_serve_e2e_tok_s", "cache"), ("prefix_serve_e2e_tok_s", "no_cache"), 0.95, at_most=False),
)


def _judge_self(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for t in SELF_TARGETS:
        for r in rows:
            if r["kind"] != "polyengine":
                continue
            v, b = metric(r, t.metric), metric(r, t.base)
            if v is None or b is None:
                continue  # the row did not run the prefix part
            ratio = v / b if b else float("inf")
            ok = ratio <= t.threshold if t.at_most else ratio >= t.threshold
            out.append({"target": t.name, "row": r["row"], "value": v, "base": b, "ratio": ratio,
                        "threshold": t.threshold, "passed": ok, "verdict": "PASS" if ok else "FAIL", "kind": "self"})
    return out


def metric(row: dict[str, Any], path: tuple[str, ...]) -> float | None:
    node: Any = row.get("metrics") or {}
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    if isinstance(node, dict):
        node = node.get("median")
    return None if node is None else float(node)


def _asked(t: Target, peer: float | None, limits: dict[str, Any] | None) -> tuple[float | None, float | None]:
    """What ``t`` asks of a row given the peer's best value (None: no peer value): the
    smaller of threshold x peer and CAP x the host limit, whichever exist (the limit
    alone only with ``limit_alone``); and the limit where it decided, else None."""
    by_peer = None if peer is None else t.threshold * peer
    limit = (limits or {}).get(t.limit) if t.limit else None
    if limit is None or (by_peer is None and not t.limit_alone):
        return by_peer, None
    if by_peer is None or CAP * limit < by_peer:
        return CAP * limit, limit
    return by_peer, None


def _verdict(t: Target, row: dict[str, Any], best: tuple[float, dict[str, Any]] | None,
             limits: dict[str, Any] | None) -> dict[str, Any]:
    v = metric(row, t.metric)
    entry: dict[str, Any] = {"target": t.name, "row": row["row"], "value": v, "threshold": t.threshold}
    if v is None:
        entry["verdict"] = "not judged: this row has no value"
        return entry
    limits = for_row(limits, row)  # the bandwidth probed around this row, where it was
    need, limit = _asked(t, None if best is None else best[0], limits)
    if need is None:
        entry["verdict"] = f"not judged: no {t.peer} row has this value" + (
            f" and the host limit {t.limit} was not measured" if t.limit_alone else "")
        return entry
    if limit is not None:
        entry.update(limit=limit, limit_name=t.limit)
        if row.get("read_probes_gb_s") and t.limit == "fp32_b1_floor_tok_s":
            entry["read_probes_gb_s"] = row["read_probes_gb_s"]
    if t.lower_is_better:
        entry["lower_is_better"] = True
    ok = v <= need if t.lower_is_better else v >= need
    peer_value = None if best is None else best[0]
    entry.update(peer_row=None if best is None else best[1]["row"], peer_value=peer_value,
                 ratio=v / peer_value if peer_value else None, needed=need, passed=ok,
                 verdict="PASS" if ok else "FAIL")
    return entry


def judge(rows: list[dict[str, Any]], work: Workload, limits: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One verdict per (target, applicable polyengine row), or, for a ``best_only``
    target, one for the row with the best value (``best_of``: the rows it was chosen
    from); or one line saying why none.

    A target with a host limit (``limits``, benchmarks/limits.py) asks for the smaller of
    threshold x the peer and 80% of the limit: what the host allows, not more."""
    out = []
    for t in targets(work):
        pick = min if t.lower_is_better else max
        peers = [(metric(r, t.metric), r) for r in rows if r["kind"] == t.peer and t.peer_rows(r)]
        best = pick(((v, r) for v, r in peers if v is not None), key=lambda vr: vr[0], default=None)
        ours = [r for r in rows if r["kind"] == "polyengine" and t.applies(r)]
        if not ours:
            out.append({"target": t.name, "row": None, "verdict": "no polyengine row in this run applies"})
            continue
        if not t.best_only:
            out += [_verdict(t, r, best, limits) for r in ours]
            continue
        valued = [(v, r) for v, r in ((metric(r, t.metric), r) for r in ours) if v is not None]
        if not valued:
            out.append({"target": t.name, "row": None, "verdict": "not judged: no polyengine row has this value"})
            continue
        entry = _verdict(t, pick(valued, key=lambda vr: vr[0])[1], best, limits)
        entry["best_of"] = [r["row"] for _, r in valued]
        out.append(entry)
    return out + _judge_self(rows)


def isa(row: dict[str, Any]) -> str | None:
    """The CPU kernels' ISA path a polyengine row ran ("avx512", "avx2", "scalar"), from
    its engine's ``speed_paths()``; None where it reports none (a fallback, another
    backend)."""
    words = ((row.get("details") or {}).get("paths") or {}).get("isa")
    return words.split()[0] if words else None


def reached(row: dict[str, Any], work: Workload, limits: dict[str, Any] | None) -> dict[str, float] | None:
    """The share of the host's limits (benchmarks/limits.py) a polyengine row reached:
    batch-1 decode against the bandwidth floor of the weights it streams (its int8
    mode's copies, else its ``weight_dtype``'s or its dtype's bytes a parameter), the largest batch's decode and
    prefill against torch's float32 GEMM rate, all in tok/s. None where the limits were
    not measured; a key is absent where the row has no value. Prefill may pass 1: its
    products are far taller than the GEMM probe's."""
    if not limits or "error" in limits or "weight_bytes" not in limits:
        return None
    limits = for_row(limits, row)
    b1, bmax = str(min(work.batches)), str(max(work.batches))
    options = (row.get("params") or {}).get("options") or {}
    narrow = options.get("weight_dtype") if options.get("weight_dtype") not in (None, "auto") else None
    kind = options.get("quantize") or narrow or _dtype(row) or "float32"
    out: dict[str, float] = {}
    v = metric(row, ("decode_tok_s", b1))
    if v is not None and kind in limits["weight_bytes"]:
        out[f"b{b1}_of_bandwidth_floor"] = v * limits["weight_bytes"][kind] / (limits["read_gb_s"] * 1e9)
    for name, path in ((f"b{bmax}_of_torch_gemm", ("decode_tok_s", bmax)), ("prefill_of_torch_gemm", ("prefill_tok_s",))):
        v = metric(row, path)
        if v is not None:
            out[name] = v / limits["fp32_gemm_tok_s"]
    return out


# -- text ----------------------------------------------------------------------------------


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


def _columns(work: Workload) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    def m(*path: str, scale: float = 1.0, ours_only: bool = False) -> Callable[[dict[str, Any]], str]:
        def cell(row: dict[str, Any]) -> str:
            if ours_only and row["kind"] != "polyengine":
                return "-"
            v = metric(row, path)
            if v is None and row.get("errors", {}).get("long" if path[0].startswith("long") else "standard"):
                return "FAIL"  # a stopped worker keeps the phases it finished; this one it did not
            return _num(None if v is None else v * scale)
        return cell

    def rss(key: str, part: str) -> Callable[[dict[str, Any]], str]:
        return lambda row: "FAIL" if row.get("errors", {}).get(part) else _num((row.get("metrics") or {}).get(key))

    def share(row: dict[str, Any]) -> str:
        got = row.get("limits_reached")
        if not got:
            return "-"
        keys = (f"b{min(work.batches)}_of_bandwidth_floor", f"b{max(work.batches)}_of_torch_gemm", "prefill_of_torch_gemm")
        return " / ".join("-" if got.get(k) is None else f"{got[k]:.2f}" for k in keys)

    cols = [("system", lambda r: r["system"]), ("setting", lambda r: r["setting"]),
            ("ISA", lambda r: r.get("isa") or "-")]
    cols += [(f"decode b{b} tok/s", m("decode_tok_s", str(b))) for b in work.batches]
    cols += [
        (f"prefill {work.prefill_len} tok/s", m("prefill_tok_s")),
        (f"serve{work.serve_requests} e2e tok/s", m("serve_e2e_tok_s")),
        (f"serve{work.serve_requests} TTFT p50 ms", m("serve_ttft_p50_s", scale=1e3)),
        ("driver ms/step", m("driver_overhead_s_per_step", scale=1e3, ours_only=True)),  # peers have no driver
        ("peak RSS MiB", rss("peak_rss_mib", "standard")),
        (f"b{work.long_batch}x{work.long_context} decode tok/s", m("long_decode_tok_s")),
        (f"b{work.long_batch}x{work.long_context} RSS MiB", rss("long_peak_rss_mib", "long")),
        (f"of host limits b{min(work.batches)}/b{max(work.batches)}/prefill", share),
    ]
    return cols


def table(rows: list[dict[str, Any]], work: Workload) -> str:
    cols = _columns(work)
    cells = [[c[1](r) for c in cols] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) if cells else len(h) for i, (h, _) in enumerate(cols)]
    right = lambda i: i >= 3  # noqa: E731 - numbers right-aligned
    line = lambda vals: "| " + " | ".join(v.rjust(w) if right(i) else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths))) + " |"  # noqa: E731
    sep = "|" + "|".join(("-" * (w + 1) + ":") if right(i) else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    return "\n".join([line([h for h, _ in cols]), sep] + [line(c) for c in cells])


def _pair(row: dict[str, Any], key: str, a: str, b: str, scale: float = 1e3) -> str:
    vals = (row.get("metrics") or {}).get(key) or {}
    if a not in vals and b not in vals:
        return "-"
    return " / ".join(_num(None if vals.get(x) is None else vals[x] * scale) for x in (a, b))


def _turns(row: dict[str, Any], which: str) -> str:
    vals = ((row.get("metrics") or {}).get("prefix_turn_ttft_s") or {}).get(which)
    return "-" if not vals else " / ".join(_num(v * 1e3) for v in vals)


def _itl(row: dict[str, Any], which: str) -> str:
    vals = ((row.get("metrics") or {}).get("prefix_loaded_itl_s") or {}).get(which)
    return "-" if not vals else " / ".join(_num(vals[k] * 1e3) for k in ("median", "p99", "max"))


def prefix_table(rows: list[dict[str, Any]]) -> str:
    """The prefix part: one line per row that ran it (``a / b`` cells: with / without)."""
    ran = [r for r in rows if any(k.startswith("prefix_") and k != "prefix_peak_rss_mib" for k in r.get("metrics") or {})]
    if not ran:
        return ""
    cols = [
        ("system", lambda r: r["system"]), ("setting", lambda r: r["setting"]),
        ("shared TTFT p50 ms cache / none", lambda r: _pair(r, "prefix_shared_ttft_p50_s", "cache", "no_cache")),
        ("shared TTFT p90 ms cache / none", lambda r: _pair(r, "prefix_shared_ttft_p90_s", "cache", "no_cache")),
        ("turn TTFT ms, cache (per turn)", lambda r: _turns(r, "cache")),
        ("turn TTFT ms, none (per turn)", lambda r: _turns(r, "no_cache")),
        ("loaded ITL ms chunked p50/p99/max", lambda r: _itl(r, "chunked")),
        ("loaded ITL ms whole p50/p99/max", lambda r: _itl(r, "whole")),
        ("long prompt TTFT ms chunked / whole", lambda r: _pair(r, "prefix_loaded_ttft_s", "chunked", "whole")),
        ("serve tok/s cache / none", lambda r: _pair(r, "prefix_serve_e2e_tok_s", "cache", "no_cache", 1.0)),
    ]
    cells = [[c(r) for _, c in cols] for r in ran]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, (h, _) in enumerate(cols)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    chunks = {r["metrics"].get("prefix_loaded_chunk") for r in ran} - {None}
    tail = f"chunked runs: prefill_chunk {', '.join(map(str, sorted(chunks)))}" if chunks else ""
    return "\n".join([line([h for h, _ in cols]), sep] + [line(c) for c in cells] + ([tail] if tail else []))


def header(doc: dict[str, Any]) -> str:
    host, work = doc["host"], Workload.from_dict(doc["workload"])
    torch = host.get("torch")
    lines = [
        f"polyengine bench ({work.name} workload), {doc['started']}",
        f"cpu: {host['cpu']['model']}, {host['cpu']['cores']} cores ({host['cpu']['usable_cores']} usable), "
        f"{host['cpu']['memory_gib']} GiB; ISA: {' '.join(host['cpu']['isa']) or 'none of interest'}",
        "torch: " + (f"{torch.get('version')}, capability {torch.get('capability')}, {torch.get('threads')} threads"
                     if torch else "not installed"),
        f"load average (1/5/15 min): {host.get('load_start')} at start, {host.get('load_end')} at end",
        f"model: {doc['model']}",
        f"workload: decode {work.prompt_len}-token prompts + {work.new_tokens} new tokens at batch "
        f"{'/'.join(map(str, work.batches))}; prefill {work.prefill_len} tokens; serve {work.serve_requests} requests "
        f"(prompts {work.serve_prompt_range[0]}-{work.serve_prompt_range[1]}, completions "
        f"{work.serve_new_range[0]}-{work.serve_new_range[1]} tokens, {work.serve_slots} slots); "
        f"long {work.long_batch} x {work.long_context} tokens",
        f"each value: median of {doc['repeats']} runs after one warm-up (long: one run, median step)",
    ]
    emulated = host.get("emulated")
    if emulated:
        env = " ".join(f"{k}={v}" for k, v in emulated["env"].items())
        lines.append(f"EMULATED: an {emulated['kind']}-only host on this CPU (ISA {' '.join(emulated['isa'])}): "
                     f"cuda_torch on isa {emulated['kind']}, every worker's torch under {env}, llama.cpp on "
                     f"{emulated.get('llamacpp_lib') or 'no library given (not run)'}; same cores, caches and memory")
    if not doc.get("complete", True):
        lines.append("INCOMPLETE: the run was stopped before every system ran")
    busy = host.get("load_start") and host["cpu"]["usable_cores"] and host["load_start"][0] > 0.5 * host["cpu"]["usable_cores"]
    if busy:
        lines.append("WARNING: the machine was busy when the run started: compare ratios within this run, not absolute numbers")
    return "\n".join(lines)


def verdicts(doc: dict[str, Any]) -> str:
    lines = ["targets, issue 27's (ratio = this row / the peer's best setting in this run):"]
    for v in doc["targets"]:
        if v.get("kind") == "self":
            lines.append(f"  {v['target']} [{v['row']}]: {v['value']:.4g} / {v['base']:.4g} = {v['ratio']:.3f} "
                         f"-> {v['verdict']}")
            continue
        if "passed" not in v:  # not judged: the entry says why
            who = f" [{v['row']}]" if v.get("row") else ""
            lines.append(f"  {v['target']}{who}: {v['verdict']}")
            continue
        who = v["row"] + (f", best of {len(v['best_of'])}" if len(v.get("best_of") or ()) > 1 else "")
        if v.get("peer_value") is None:
            got = f"{_num(v['value'])}, no peer value"
        else:
            ratio = "-" if v.get("ratio") is None else f"{v['ratio']:.2f}x"
            got = f"{_num(v['value'])} / {_num(v['peer_value'])} ({v['peer_row']}) = {ratio}"
        basis = (f"{CAP:.0%} of {_num(v['limit'])} ({v['limit_name']})" if v.get("limit") is not None
                 else f"{v['threshold']:g}x the peer")
        if v.get("read_probes_gb_s"):
            basis += ", read " + " / ".join("-" if p is None else f"{p:.1f}" for p in v["read_probes_gb_s"]) + \
                " GB/s right before / after the row"

        bound = "at most" if v.get("lower_is_better") else "at least"
        lines.append(f"  {v['target']} [{who}]: {got}; asked {bound} {_num(v['needed'])} = {basis} -> {v['verdict']}")
    limits = doc["host"].get("limits")
    if limits and "error" not in limits:
        lines.append(
            f"host limits: memory read {limits['read_gb_s']:.1f} GB/s before the jobs -> float32 batch-1 floor "
            f"{limits['fp32_b1_floor_tok_s']:.0f} tok/s ({limits['params'] / 1e6:.0f}M parameters); torch float32 GEMM "
            f"{limits['gemm_gflop_s']:.0f} GFLOP/s at {'x'.join(map(str, limits['gemm_shape']))} -> "
            f"{limits['fp32_gemm_tok_s']:.0f} tok/s at the largest batch; a row's 'of host limits' column: its "
            f"batch-1 decode over the bandwidth floor of the weights it streams, its largest batch and prefill over "
            f"that GEMM rate (the floor from the mean of the reads probed right before and after the row, "
            f"where they were)")
    elif limits:
        lines.append(f"host limits: {limits['error']}")
    return "\n".join(lines)


def builds(rows: list[dict[str, Any]]) -> list[str]:
    """One line per engine a polyengine row built (slots x prefill x cache): its build time,
    the programs compiled or loaded from a cache (from the engine's ``bench_report()``), and
    the engine's other stats. Empty when no row reports more than a build time under 1 s."""
    lines = []
    for r in rows:
        for b in (r.get("details") or {}).get("engine_builds") or []:
            slots, prefill, cache = b["shape"]
            line = f"  {r['row']} [{slots} slots, prefill {prefill}, cache {cache}]: built in {b['seconds']:.2f} s"
            compiled = [c for c in b.get("compile") or [] if c.get("source") == "compiled"]
            cached = [c for c in b.get("compile") or [] if c.get("source") != "compiled"]
            if compiled:
                line += f"; compiled {len(compiled)} ({sum(c['seconds'] for c in compiled):.1f} s): " + ", ".join(
                    f"{c['program']}[{c['bucket']}] {c['seconds']:.1f} s" for c in compiled)
            if cached:
                line += f"; from cache {len(cached)} ({sum(c['seconds'] for c in cached):.2f} s)"
            stats = {k: v for k, v in b.items() if k not in ("shape", "seconds", "compile")}
            if stats:
                line += "; " + ", ".join(f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}" for k, v in stats.items())
            if b.get("compile") or stats or b["seconds"] >= 1.0:
                lines.append(line)
    return lines


def render(doc: dict[str, Any]) -> str:
    work = Workload.from_dict(doc["workload"])
    parts = [header(doc), "", table(doc["rows"], work)]
    prefix = prefix_table(doc["rows"])
    if prefix:
        parts += ["", "prefix caching and chunked prefill (prefix part):", prefix]
    parts += ["", verdicts(doc)]
    built = builds(doc["rows"])
    if built:
        parts += ["", "engine builds (construction, compilation, engine stats):", *built]
    notes = [f"  {n}" for n in doc.get("notes", [])] + [f"  {n}" for r in doc["rows"] for n in r.get("notes") or []]
    fails = [f"  {r['row']} ({part}): {err}" for r in doc["rows"] for part, err in r.get("errors", {}).items() if err]
    if notes:
        parts += ["", "notes:", *notes]
    if fails:
        parts += ["", "failures:", *fails]
    return "\n".join(parts)


def write_json(doc: dict[str, Any], path: str | Path) -> Path:
    """Write the report; if ``path`` fails now, the report goes to a temporary file
    (named on standard error) rather than being lost. Returns where it went."""
    from polyengine.files import write_report

    return write_report(path, json.dumps(doc, indent=2, default=str) + "\n", what="bench report")


def rss_mib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / MIB
