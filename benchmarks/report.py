"""The report: the host header, one table row per system and setting, the verdicts, the JSON.

A row's metrics are the medians of its runs (``phases``); the JSON keeps every sample
and its spread. Each polyengine row also carries the CPU kernels' ISA path it ran
(``isa``) and the share of the host's limits it reached (``reached``, against
benchmarks/limits.py: the batch-1 decode over the bandwidth floor of the weights it
streams, the largest batch's decode and prefill over torch's float32 GEMM rate). The
floor a row is measured against comes from the memory reads probed right before and
after that row (``limits.for_row``), not from the one before all jobs.

Verdicts appear only when the run was given targets (``--targets``, ``verdicts``): a
measurement is not a test. A table cell of a phase that did not run reads ``error``,
and the failure is listed under ``failures:``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from polyengine.benchmarks import verdicts
from polyengine.benchmarks.limits import for_row
from polyengine.benchmarks.stats import MIB
from polyengine.benchmarks.verdicts import metric, number_text
from polyengine.benchmarks.workload import Workload

__all__ = ["SCHEMA", "render", "write_json", "isa", "reached", "table", "header", "limits_line", "builds"]

SCHEMA = "polyengine-bench/1"


def isa(row: dict[str, Any]) -> str | None:
    """The CPU kernels' ISA path a polyengine row ran ("avx512", "avx2", "scalar"), from
    its engine's ``speed_paths()``; None where it reports none (a fallback, another
    backend)."""
    words = ((row.get("details") or {}).get("paths") or {}).get("isa")
    return words.split()[0] if words else None


def _narrow_stored(limits: dict[str, Any]) -> int | None:
    """The bytes a batch-1 step streams of a model stored narrower than 16 bits a
    weight (a GGUF file's blocks: limits ``weight_bytes["stored"]``), else None."""
    sizes = limits.get("weight_bytes") or {}
    stored = sizes.get("stored")
    return stored if stored and stored < sizes.get("float16", 0) else None


def reached(row: dict[str, Any], work: Workload, limits: dict[str, Any] | None) -> dict[str, float] | None:
    """The share of the host's limits (benchmarks/limits.py) a polyengine row reached:
    batch-1 decode against the bandwidth floor of the weights it streams (its int8
    mode's copies, else its ``weight_dtype``'s or its dtype's bytes a parameter) and, for
    a model stored narrower than 16 bits a weight (a GGUF file's blocks), against the
    floor of its bytes as stored (``b1_of_stored_floor``), the largest batch's decode and
    prefill against torch's float32 GEMM rate, all in tok/s. None where the limits were
    not measured; a key is absent where the row has no value. Prefill may pass 1: its
    products are far taller than the GEMM probe's."""
    if not limits or "error" in limits or "weight_bytes" not in limits:
        return None
    limits = for_row(limits, row)
    b1, bmax = str(min(work.batches)), str(max(work.batches))
    options = (row.get("params") or {}).get("options") or {}
    narrow = options.get("weight_dtype") if options.get("weight_dtype") not in (None, "auto") else None
    kind = options.get("quantize") or narrow or verdicts.dtype(row) or "float32"
    out: dict[str, float] = {}
    v = metric(row, ("decode_tok_s", b1))
    if v is not None and kind in limits["weight_bytes"]:
        out[f"b{b1}_of_bandwidth_floor"] = v * limits["weight_bytes"][kind] / (limits["read_gb_s"] * 1e9)
    stored = _narrow_stored(limits)
    if v is not None and stored:  # the floor of streaming the file as stored
        out[f"b{b1}_of_stored_floor"] = v * stored / (limits["read_gb_s"] * 1e9)
    for name, path in ((f"b{bmax}_of_torch_gemm", ("decode_tok_s", bmax)), ("prefill_of_torch_gemm", ("prefill_tok_s",))):
        v = metric(row, path)
        if v is not None:
            out[name] = v / limits["fp32_gemm_tok_s"]
    return out


# -- text ----------------------------------------------------------------------------------


def _columns(work: Workload) -> list[tuple[str, str | None, Callable[[dict[str, Any]], str]]]:
    """(header, the phase or part that fills it (None: always shown), cell) per column."""
    def m(*path: str, scale: float = 1.0, ours_only: bool = False) -> Callable[[dict[str, Any]], str]:
        def cell(row: dict[str, Any]) -> str:
            if ours_only and row["kind"] != "polyengine":
                return "-"
            v = metric(row, path)
            if v is None and row.get("errors", {}).get("long" if path[0].startswith("long") else "standard"):
                return "error"  # a stopped worker keeps the phases it finished; this one it did not
            return number_text(None if v is None else v * scale)
        return cell

    def rss(key: str, part: str) -> Callable[[dict[str, Any]], str]:
        return lambda row: "error" if row.get("errors", {}).get(part) else number_text((row.get("metrics") or {}).get(key))

    def share(row: dict[str, Any]) -> str:
        got = row.get("limits_reached")
        if not got:
            return "-"
        b1 = min(work.batches)  # a file stored in blocks: the floor of its bytes as stored
        floor = f"b{b1}_of_stored_floor" if f"b{b1}_of_stored_floor" in got else f"b{b1}_of_bandwidth_floor"
        keys = (floor, f"b{max(work.batches)}_of_torch_gemm", "prefill_of_torch_gemm")
        return " / ".join("-" if got.get(k) is None else f"{got[k]:.2f}" for k in keys)


    cols = [("system", None, lambda r: r["system"]), ("setting", None, lambda r: r["setting"]),
            ("ISA", None, lambda r: r.get("isa") or "-")]
    cols += [(f"decode b{b} tok/s", "decode", m("decode_tok_s", str(b))) for b in work.batches]
    cols += [
        (f"prefill {work.prefill_len} tok/s", "prefill", m("prefill_tok_s")),
        (f"serve{work.serve_requests} e2e tok/s", "serve", m("serve_e2e_tok_s")),
        (f"serve{work.serve_requests} TTFT p50 ms", "serve", m("serve_ttft_p50_s", scale=1e3)),
        ("driver ms/step", "serve", m("driver_overhead_s_per_step", scale=1e3, ours_only=True)),  # peers have no driver
        ("peak RSS MiB", "standard", rss("peak_rss_mib", "standard")),
        ("load s", "standard", m("load_s")),
        (f"b{work.long_batch}x{work.long_context} decode tok/s", "long", m("long_decode_tok_s")),
        (f"b{work.long_batch}x{work.long_context} RSS MiB", "long", rss("long_peak_rss_mib", "long")),
        (f"of host limits b{min(work.batches)}/b{max(work.batches)}/prefill", "limits", share),
    ]
    return cols


def table(rows: list[dict[str, Any]], work: Workload, ran: list[str] | None = None) -> str:
    """The main table; ``ran``: the parts and phases this run asked for (the document's
    ``parts`` and ``phases``): the columns of the others are left out. None: every column."""
    cols = [(h, cell) for h, what, cell in _columns(work) if ran is None or what is None or what in ran]
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
    return " / ".join(number_text(None if vals.get(x) is None else vals[x] * scale) for x in (a, b))


def _turns(row: dict[str, Any], which: str) -> str:
    vals = ((row.get("metrics") or {}).get("prefix_turn_ttft_s") or {}).get(which)
    return "-" if not vals else " / ".join(number_text(v * 1e3) for v in vals)


def _itl(row: dict[str, Any], which: str) -> str:
    vals = ((row.get("metrics") or {}).get("prefix_loaded_itl_s") or {}).get(which)
    return "-" if not vals else " / ".join(number_text(vals[k] * 1e3) for k in ("median", "p99", "max"))


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


def pages_table(rows: list[dict[str, Any]]) -> str:
    """The pages part: one line per (row, variant, setting) that ran it."""
    ran = [r for r in rows if (r.get("metrics") or {}).get("pages_runs")]
    if not ran:
        return ""
    head = ["row", "prompts", "engine", "K/V MiB", "done / failed", "peak running", "preemptions", "peak pages",
            "cached tokens", "seconds", "CPU s", "tok/s"]
    cells = []
    for r in ran:
        m = r["metrics"]
        w = m.get("pages_workload") or {}
        for variant, settings in m["pages_runs"].items():
            for setting, run in settings.items():
                engine = (f"paged: {run['pool_pages']} pages of {w.get('page_size')}, {run['requests']} slots"
                          if run.get("pool_pages") else
                          f"reserved: {w.get('reserved_slots')} slots x {w.get('context')}")
                cells.append([r["row"], variant, engine, number_text(run["kv_mib"]),
                              f"{run['completed']} / {run['failed']}", str(run["peak_running"]), str(run["preemptions"]),
                              "-" if run.get("peak_pages") is None else str(run["peak_pages"]),
                              str(run["cached_tokens"]), number_text(run["seconds"]),
                              number_text(run.get("cpu_seconds")),
                              number_text(run["completion_tokens"] / run["seconds"] if run["seconds"] else None)])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    right = lambda i: i >= 3  # noqa: E731 - numbers right-aligned
    line = lambda vals: "| " + " | ".join(v.rjust(w) if right(i) else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths))) + " |"  # noqa: E731
    sep = "|" + "|".join(("-" * (w + 1) + ":") if right(i) else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    w = ran[0]["metrics"].get("pages_workload") or {}
    tail = (f"{w.get('requests')} requests of {w.get('prompt')} prompt tokens (shared: the first {w.get('system')} one "
            f"system prompt) + {w.get('new_tokens')} new, submitted at once, greedy, EOS ignored; context "
            f"{w.get('context')}. Counts and memory are exact; seconds depend on the host's load, "
            f"CPU s (the worker's CPU time over those seconds) much less.")
    return "\n".join([line(head), sep] + [line(c) for c in cells] + [tail])


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
        "workload: " + "; ".join(text for what, text in (
            ("decode", f"decode {work.prompt_len}-token prompts + {work.new_tokens} new tokens at batch "
                       f"{'/'.join(map(str, work.batches))}"),
            ("prefill", f"prefill {work.prefill_len} tokens"),
            ("serve", f"serve {work.serve_requests} requests (prompts {work.serve_prompt_range[0]}-"
                      f"{work.serve_prompt_range[1]}, completions {work.serve_new_range[0]}-{work.serve_new_range[1]} "
                      f"tokens, {work.serve_slots} slots)"),
            ("long", f"long {work.long_batch} x {work.long_context} tokens"),
            ("pages", f"pages {work.pages_requests} requests of {work.pages_prompt} + {work.pages_new_tokens} tokens "
                      f"in {work.pages_pool} pages of {work.pages_page_size} (vs {work.pages_reserved_slots} slots x "
                      f"{work.pages_context})"),
        ) if what in doc.get("phases", ("decode", "prefill", "serve")) or what in doc.get("parts", ("long",))),
        f"each value: median of {doc['repeats']} runs after one warm-up (long: one run, median step)",
    ]
    emulated = host.get("emulated")
    if emulated:
        env = " ".join(f"{k}={v}" for k, v in emulated["env"].items())
        lines.append(f"EMULATED: an {emulated['kind']}-only host on this CPU (ISA {' '.join(emulated['isa'])}): "
                     f"polyengine's CPU kernels on isa {emulated['kind']}, every worker's torch under {env}, llama.cpp on "
                     f"{emulated.get('llamacpp_lib') or 'no library given (not run)'}; same cores, caches and memory")
    if not doc.get("complete", True):
        lines.append("INCOMPLETE: the run was stopped before every system ran")
    busy = host.get("load_start") and host["cpu"]["usable_cores"] and host["load_start"][0] > 0.5 * host["cpu"]["usable_cores"]
    if busy:
        lines.append("WARNING: the machine was busy when the run started: compare ratios within this run, not absolute numbers")
    return "\n".join(lines)


def limits_line(doc: dict[str, Any]) -> str:
    """What the host's limits were (the "of host limits" column's denominators), or ""."""
    limits = doc["host"].get("limits")
    if limits and "error" in limits:
        return f"host limits: {limits['error']}"
    if not limits:
        return ""
    stored = _narrow_stored(limits) if limits.get("stored_b1_floor_tok_s") else None
    return (f"host limits: memory read {limits['read_gb_s']:.1f} GB/s before the jobs -> float32 batch-1 floor "
            f"{limits['fp32_b1_floor_tok_s']:.0f} tok/s ({limits['params'] / 1e6:.0f}M parameters)"
            + (f", the file's tensors as stored {limits['stored_b1_floor_tok_s']:.0f} tok/s ({stored / 1e6:.0f} MB a "
               f"step)" if stored else "") + "; torch float32 GEMM "
            f"{limits['gemm_gflop_s']:.0f} GFLOP/s at {'x'.join(map(str, limits['gemm_shape']))} -> "
            f"{limits['fp32_gemm_tok_s']:.0f} tok/s at the largest batch; a row's 'of host limits' column: its "
            f"batch-1 decode over the bandwidth floor of the weights it streams, its largest batch and prefill over "
            f"that GEMM rate (the floor from the mean of the reads probed right before and after the row, "
            f"where they were)")

def builds(rows: list[dict[str, Any]]) -> list[str]:
    """One line per engine a polyengine row built (slots x prefill x cache): its build time,
    the programs compiled or loaded from a cache (from the engine's ``bench_report()``), and
    the engine's other stats. Empty when no row reports more than a build time under 1 s."""
    lines = []
    for r in rows:
        for b in (r.get("details") or {}).get("engine_builds") or []:
            slots, prefill, cache = b["shape"]
            line = f"  {r['row']} [{slots} slot{'s' if slots != 1 else ''}, prefill {prefill}, cache {cache}]: built in {b['seconds']:.2f} s"
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
    ran = None if "parts" not in doc else [*doc["parts"], *doc.get("phases", ()),
                                           *(["limits"] if doc["host"].get("limits") else [])]
    parts = [header(doc)] + (["", table(doc["rows"], work, ran)] if doc["rows"] or not doc.get("served") else [])
    prefix = prefix_table(doc["rows"])
    if prefix:
        parts += ["", "prefix caching and chunked prefill (prefix part):", prefix]
    pages = pages_table(doc["rows"])
    if pages:
        parts += ["", "paged K/V against full reservations (pages part):", pages]
    if doc.get("served"):
        from polyengine.benchmarks import served

        sv = doc["served"]
        systems = [served.ServedSystem(**x) for x in sv["systems"]]
        parts += ["", f"HTTP servers (served part): {sv['slots']} slots each, {sv['per_client']} streamed requests per "
                      f"client of {sv['new_tokens']} new tokens ({_served_sampling(sv.get('temperature') or 0.0)}, "
                      f"EOS ignored), llama-server on "
                      f"{sv['llama_server_threads']} threads:", served.table(systems, sv["verdicts"])]
    limits = limits_line(doc)
    if limits:
        parts += ["", limits]
    if doc.get("targets_from"):
        parts += ["", verdicts.text(doc["targets"], doc.get("target_titles"))]
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


def _served_sampling(temperature: float) -> str:
    """How the served part's requests chose their tokens."""
    return "greedy" if temperature == 0 else f"sampled at temperature {temperature:g}, seeded, no filters"
