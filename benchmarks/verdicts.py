"""Targets a bench run is judged against, read from a file the user passes, and the verdicts.

``polyengine bench`` measures; it judges only when asked: ``--targets FILE`` (repeatable)
names a TOML (``.toml``) or JSON (``.json``) file of targets, and the report then gets
one PASS/FAIL line per verdict. Without it the report has no verdicts at all. The
project's own files live in ``benchmarks/targets/`` (docs/benchmarks.md#targets).

A file holds an optional ``title`` and two lists of tables (the JSON form: the same
keys in one object):

``[[compare]]``, a polyengine row against the best value any setting of a peer reached
in this run (the highest, or the lowest with ``better = "lower"``)::

    name = "float32 decode b{smallest_batch} >= 3x transformers"  # shown in the report
    metric = "decode_tok_s.{smallest_batch}"  # a dotted path into a row's metrics
    peer = "transformers"                      # or "llamacpp"
    ratio = 3.0                                # asked: ratio x the peer's best value
    rows = "float32"                           # which polyengine rows: all (default), float32, int8
    peer_setting = "Q4_1"                      # optional: only the peer rows of this quant or dtype
    judge = "best"                             # "each" row (default) or only the "best" of them
    better = "higher"                          # or "lower" (memory): asked at most ratio x the peer
    host_limit = "fp32_b1_floor_tok_s"         # optional: ask at most CAP (80%) of this host limit
    limit_alone = true                         # with host_limit: ask 80% of it when no peer ran

``[[within_row]]``, a ratio of two metrics of one polyengine row (measured in the same
worker), ``metric / base`` at most ``at_most`` or at least ``at_least``::

    name = "shared prefix TTFT p50 with the cache <= 1/5 without"
    metric = "prefix_shared_ttft_p50_s.cache"
    base = "prefix_shared_ttft_p50_s.no_cache"
    at_most = 0.2

Names and metric paths may hold ``{smallest_batch}``, ``{largest_batch}``,
``{prefill_len}``, ``{long_batch}`` and ``{long_context}``: the run's workload fills them
in, so one file serves the standard and the ``--quick`` workload. Host limits are
``benchmarks/limits.py``'s (``fp32_b1_floor_tok_s``, ``stored_b1_floor_tok_s``: the
weights as the file stores them, ``fp32_gemm_tok_s``); a row's
bandwidth floor is the one probed right before and after that row (``limits.for_row``).

Which rows ``rows`` selects: ``float32`` every row that streams float32 weights
(engine dtype float32, no int8 option, no ``weight_dtype`` other than auto/float32);
``int8`` every row whose options mention int8 in a key or value. A ``best`` target
gives one verdict, for the polyengine row with the best value among those it applies
to, and names the rows it was chosen from (``best_of``).

A malformed file is refused before anything runs (``InvalidRequest`` naming the file,
the entry and the key).
"""

from __future__ import annotations

import json
import string
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyengine.benchmarks.limits import BANDWIDTH_LIMITS, CAP, for_row
from polyengine.benchmarks.workload import Workload

__all__ = ["Compare", "WithinRow", "TargetSet", "load", "judge", "text", "metric", "is_int8", "METRICS",
           "HOST_LIMITS", "ROWS", "dtype", "number_text"]

# The first part of a metric path: what a row's ``metrics`` holds (docs/benchmarks.md).
METRICS = frozenset({
    "decode_tok_s", "prefill_tok_s", "serve_e2e_tok_s", "serve_ttft_p50_s", "driver_overhead_s_per_step",
    "peak_rss_mib", "load_s", "long_decode_tok_s", "long_peak_rss_mib", "prefix_peak_rss_mib", "prefix_shared_ttft_p50_s",
    "prefix_shared_ttft_p90_s", "prefix_turn_ttft_s", "prefix_loaded_itl_s", "prefix_loaded_ttft_s",
    "prefix_serve_e2e_tok_s",
})
HOST_LIMITS = frozenset({"fp32_b1_floor_tok_s", "stored_b1_floor_tok_s", "fp32_gemm_tok_s"})
ROWS = ("all", "float32", "int8")
PEERS = ("transformers", "llamacpp")
_FIELDS = ("smallest_batch", "largest_batch", "prefill_len", "long_batch", "long_context")
_LIMIT = 1 << 20  # bytes: a targets file is a few hundred


@dataclass(frozen=True)
class Compare:
    """A polyengine row's ``metric`` against ``ratio`` x the best value of ``peer``."""

    name: str
    metric: str
    peer: str
    ratio: float
    rows: str = "all"
    peer_setting: str | None = None
    judge: str = "each"
    better: str = "higher"
    host_limit: str | None = None
    limit_alone: bool = False


@dataclass(frozen=True)
class WithinRow:
    """``metric / base`` of one polyengine row, at most ``at_most`` or at least ``at_least``."""

    name: str
    metric: str
    base: str
    at_most: float | None = None
    at_least: float | None = None


@dataclass(frozen=True)
class TargetSet:
    source: str
    title: str
    compare: tuple[Compare, ...]
    within_row: tuple[WithinRow, ...]


def _refuse(source: str, message: str) -> Exception:
    from polyengine.errors import InvalidRequest

    return InvalidRequest(f"--targets {source}: {message} (the format: docs/benchmarks.md#targets)")


def load(path: str | Path) -> TargetSet:
    """The targets of ``path`` (``.toml`` or ``.json``), checked whole before any job."""
    from polyengine.errors import InvalidRequest
    from polyengine.files import read_regular

    source, suffix = str(path), Path(path).suffix.lower()
    if suffix not in (".toml", ".json"):
        raise _refuse(source, f"the file must end in .toml or .json, not {suffix or 'nothing'!r}")
    raw = read_regular(Path(path).expanduser(), limit=_LIMIT, what=f"targets file {source}", error=InvalidRequest)
    try:
        data = tomllib.loads(raw.decode("utf-8")) if suffix == ".toml" else json.loads(raw)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise _refuse(source, f"not valid {suffix[1:].upper()}: {exc}") from None
    if not isinstance(data, dict):
        raise _refuse(source, "the file must hold a table (a JSON object)")
    _keys(source, "the file", data, {"title", "compare", "within_row"})
    compare = tuple(_compare(source, i, e) for i, e in enumerate(_entries(source, data, "compare")))
    within = tuple(_within(source, i, e) for i, e in enumerate(_entries(source, data, "within_row")))
    if not compare and not within:
        raise _refuse(source, "it holds no [[compare]] or [[within_row]] target")
    title = data.get("title", Path(path).stem)
    if not isinstance(title, str):
        raise _refuse(source, "title must be a string")
    return TargetSet(source, title, compare, within)


def _entries(source: str, data: dict[str, Any], key: str) -> list[dict[str, Any]]:
    entries = data.get(key, [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise _refuse(source, f"{key} must be a list of tables ([[{key}]] in TOML)")
    return entries


def _keys(source: str, where: str, entry: dict[str, Any], allowed: set[str], required: tuple[str, ...] = ()) -> None:
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise _refuse(source, f"{where}: unknown key(s) {unknown}; allowed: {', '.join(sorted(allowed))}")
    missing = [k for k in required if k not in entry]
    if missing:
        raise _refuse(source, f"{where}: missing {', '.join(missing)}")


def _text(source: str, where: str, entry: dict[str, Any], key: str, metric_path: bool = False) -> str:
    value = entry[key]
    if not isinstance(value, str) or not value:
        raise _refuse(source, f"{where}: {key} must be a non-empty string")
    names = {f for _, f, _, _ in string.Formatter().parse(value) if f is not None}
    if names - set(_FIELDS):
        raise _refuse(source, f"{where}: {key} {value!r} names {sorted(names - set(_FIELDS))}; the workload fills in "
                              f"{', '.join('{' + f + '}' for f in _FIELDS)}")
    if metric_path and value.split(".")[0] not in METRICS:
        raise _refuse(source, f"{where}: {key} {value!r} is no metric; its first part is one of "
                              f"{', '.join(sorted(METRICS))}")
    return value


def _number(source: str, where: str, entry: dict[str, Any], key: str) -> float:
    value = entry[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise _refuse(source, f"{where}: {key} must be a positive number, not {value!r}")
    return float(value)


def _choice(source: str, where: str, entry: dict[str, Any], key: str, choices: tuple[str, ...], default: str) -> str:
    value = entry.get(key, default)
    if value not in choices:
        raise _refuse(source, f"{where}: {key} must be one of {', '.join(choices)}, not {value!r}")
    return value


def _compare(source: str, i: int, e: dict[str, Any]) -> Compare:
    where = f"compare #{i + 1}" + (f" ({e['name']!r})" if isinstance(e.get("name"), str) else "")
    _keys(source, where, e, {"name", "metric", "peer", "ratio", "rows", "peer_setting", "judge", "better",
                             "host_limit", "limit_alone"}, ("name", "metric", "peer", "ratio"))
    limit = e.get("host_limit")
    if limit is not None and limit not in HOST_LIMITS:
        raise _refuse(source, f"{where}: host_limit must be one of {', '.join(sorted(HOST_LIMITS))}, not {limit!r}")
    better = _choice(source, where, e, "better", ("higher", "lower"), "higher")
    if limit is not None and better == "lower":
        raise _refuse(source, f"{where}: a host limit caps what a higher-is-better target asks; drop host_limit")
    alone = e.get("limit_alone", False)
    if not isinstance(alone, bool) or (alone and limit is None):
        raise _refuse(source, f"{where}: limit_alone is true or false, and needs host_limit")
    setting = e.get("peer_setting")
    if setting is not None and (not isinstance(setting, str) or not setting):
        raise _refuse(source, f"{where}: peer_setting must be a quant or dtype name, e.g. 'Q4_1' or 'float32'")
    return Compare(_text(source, where, e, "name"), _text(source, where, e, "metric", True),
                   _choice(source, where, e, "peer", PEERS, ""), _number(source, where, e, "ratio"),
                   _choice(source, where, e, "rows", ROWS, "all"), setting,
                   _choice(source, where, e, "judge", ("each", "best"), "each"), better, limit, alone)


def _within(source: str, i: int, e: dict[str, Any]) -> WithinRow:
    where = f"within_row #{i + 1}" + (f" ({e['name']!r})" if isinstance(e.get("name"), str) else "")
    _keys(source, where, e, {"name", "metric", "base", "at_most", "at_least"}, ("name", "metric", "base"))
    if ("at_most" in e) == ("at_least" in e):
        raise _refuse(source, f"{where}: give exactly one of at_most and at_least")
    bound = "at_most" if "at_most" in e else "at_least"
    value = _number(source, where, e, bound)
    return WithinRow(_text(source, where, e, "name"), _text(source, where, e, "metric", True),
                     _text(source, where, e, "base", True), **{bound: value})


# -- judging ---------------------------------------------------------------------------------


def is_int8(options: dict[str, Any]) -> bool:
    return any("int8" in str(k).lower() or "int8" in str(v).lower() for k, v in (options or {}).items())


def dtype(row: dict[str, Any]) -> str | None:
    return (row.get("details") or {}).get("dtype") or (row.get("params") or {}).get("dtype")


def _selects(which: str, row: dict[str, Any]) -> bool:
    """``rows``: float32 rows stream float32 weights (bfloat16 weights under float32
    compute stream half the bytes: not float32); int8 rows name int8 in their options."""
    options = (row.get("params") or {}).get("options") or {}
    if which == "int8":
        return is_int8(options)
    if which == "float32":
        weights = str(options.get("weight_dtype", "auto")).lower()
        return dtype(row) == "float32" and not is_int8(options) and weights in ("auto", "float32")
    return True


def _peer_setting(setting: str | None, row: dict[str, Any]) -> bool:
    params = row.get("params") or {}
    return setting is None or setting in (params.get("quant"), params.get("dtype"))


def metric(row: dict[str, Any], path: tuple[str, ...]) -> float | None:
    """The value at ``path`` in a row's metrics (a summary's median), or None."""
    node: Any = row.get("metrics") or {}
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    if isinstance(node, dict):
        node = node.get("median")
    return None if node is None else float(node)


def _fill(text_: str, work: Workload) -> str:
    return text_.format(smallest_batch=min(work.batches), largest_batch=max(work.batches),
                        prefill_len=work.prefill_len, long_batch=work.long_batch, long_context=work.long_context)


def _path(text_: str, work: Workload) -> tuple[str, ...]:
    return tuple(_fill(text_, work).split("."))


def _asked(t: Compare, peer: float | None, limits: dict[str, Any] | None) -> tuple[float | None, float | None]:
    """What ``t`` asks given the peer's best value (None: no peer value): the smaller of
    ratio x peer and CAP x the host limit, whichever exist (the limit alone only with
    ``limit_alone``); and the limit where it decided, else None."""
    by_peer = None if peer is None else t.ratio * peer
    limit = (limits or {}).get(t.host_limit) if t.host_limit else None
    if limit is None or (by_peer is None and not t.limit_alone):
        return by_peer, None
    if by_peer is None or CAP * limit < by_peer:
        return CAP * limit, limit
    return by_peer, None


def _verdict(t: Compare, name: str, path: tuple[str, ...], row: dict[str, Any],
             best: tuple[float, dict[str, Any]] | None, limits: dict[str, Any] | None) -> dict[str, Any]:
    v = metric(row, path)
    entry: dict[str, Any] = {"target": name, "row": row["row"], "value": v, "threshold": t.ratio}
    if v is None:
        entry["verdict"] = "not judged: this row has no value"
        return entry
    limits = for_row(limits, row)  # the bandwidth probed around this row, where it was
    need, limit = _asked(t, None if best is None else best[0], limits)
    if need is None:
        entry["verdict"] = f"not judged: no {t.peer} row has this value" + (
            f" and the host limit {t.host_limit} was not measured" if t.limit_alone else "")
        return entry
    if limit is not None:
        entry.update(limit=limit, limit_name=t.host_limit)
        if row.get("read_probes_gb_s") and t.host_limit in BANDWIDTH_LIMITS:
            entry["read_probes_gb_s"] = row["read_probes_gb_s"]
    lower = t.better == "lower"
    if lower:
        entry["lower_is_better"] = True
    ok = v <= need if lower else v >= need
    peer_value = None if best is None else best[0]
    entry.update(peer_row=None if best is None else best[1]["row"], peer_value=peer_value,
                 ratio=v / peer_value if peer_value else None, needed=need, passed=ok,
                 verdict="PASS" if ok else "FAIL")
    return entry


def _judge_compare(t: Compare, rows: list[dict[str, Any]], work: Workload,
                   limits: dict[str, Any] | None) -> list[dict[str, Any]]:
    name, path = _fill(t.name, work), _path(t.metric, work)
    pick = min if t.better == "lower" else max
    peers = [(metric(r, path), r) for r in rows if r["kind"] == t.peer and _peer_setting(t.peer_setting, r)]
    best = pick(((v, r) for v, r in peers if v is not None), key=lambda vr: vr[0], default=None)
    ours = [r for r in rows if r["kind"] == "polyengine" and _selects(t.rows, r)]
    if not ours:
        return [{"target": name, "row": None, "verdict": "no polyengine row in this run applies"}]
    if t.judge == "each":
        return [_verdict(t, name, path, r, best, limits) for r in ours]
    valued = [(v, r) for v, r in ((metric(r, path), r) for r in ours) if v is not None]
    if not valued:
        return [{"target": name, "row": None, "verdict": "not judged: no polyengine row has this value"}]
    entry = _verdict(t, name, path, pick(valued, key=lambda vr: vr[0])[1], best, limits)
    entry["best_of"] = [r["row"] for _, r in valued]
    return [entry]


def _judge_within(t: WithinRow, rows: list[dict[str, Any]], work: Workload) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        if r["kind"] != "polyengine":
            continue
        v, b = metric(r, _path(t.metric, work)), metric(r, _path(t.base, work))
        if v is None or b is None:
            continue  # the row did not run the part that measures it
        ratio = v / b if b else float("inf")
        ok = ratio <= t.at_most if t.at_most is not None else ratio >= t.at_least
        out.append({"target": _fill(t.name, work), "row": r["row"], "value": v, "base": b, "ratio": ratio,
                    "threshold": t.at_most if t.at_most is not None else t.at_least, "passed": ok,
                    "verdict": "PASS" if ok else "FAIL", "kind": "self"})
    return out


def judge(sets: list[TargetSet], rows: list[dict[str, Any]], work: Workload,
          limits: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every verdict of ``sets`` on this run's ``rows``: per (target, applicable row), or
    for a ``best`` target one for the best row; a line saying why where none is judged.
    Each verdict names the file it came from (``source``)."""
    out = []
    for s in sets:
        judged = [v for t in s.compare for v in _judge_compare(t, rows, work, limits)]
        judged += [v for t in s.within_row for v in _judge_within(t, rows, work)]
        out += [{**v, "source": s.source} for v in judged]
    return out


def number_text(x: float | None) -> str:
    """A value as the report prints it: one decimal below 100, whole above, "-" for none."""
    if x is None:
        return "-"
    return f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


def _line(v: dict[str, Any]) -> str:
    if v.get("kind") == "self":
        return f"  {v['target']} [{v['row']}]: {v['value']:.4g} / {v['base']:.4g} = {v['ratio']:.3f} -> {v['verdict']}"
    if "passed" not in v:  # not judged: the entry says why
        return f"  {v['target']}" + (f" [{v['row']}]" if v.get("row") else "") + f": {v['verdict']}"
    who = v["row"] + (f", best of {len(v['best_of'])}" if len(v.get("best_of") or ()) > 1 else "")
    if v.get("peer_value") is None:
        got = f"{number_text(v['value'])}, no peer value"
    else:
        ratio = "-" if v.get("ratio") is None else f"{v['ratio']:.2f}x"
        got = f"{number_text(v['value'])} / {number_text(v['peer_value'])} ({v['peer_row']}) = {ratio}"
    basis = (f"{CAP:.0%} of {number_text(v['limit'])} ({v['limit_name']})" if v.get("limit") is not None
             else f"{v['threshold']:g}x the peer")
    if v.get("read_probes_gb_s"):
        basis += ", read " + " / ".join("-" if p is None else f"{p:.1f}" for p in v["read_probes_gb_s"]) + \
            " GB/s right before / after the row"
    bound = "at most" if v.get("lower_is_better") else "at least"
    return f"  {v['target']} [{who}]: {got}; asked {bound} {number_text(v['needed'])} = {basis} -> {v['verdict']}"


def text(verdicts: list[dict[str, Any]], titles: dict[str, str] | None = None) -> str:
    """The verdicts as report lines, under one heading per targets file."""
    lines: list[str] = []
    for source in dict.fromkeys(v.get("source") for v in verdicts):
        title = (titles or {}).get(source) if source else None
        head = f"targets from {source}" + (f" ({title})" if title else "") if source else "targets"
        lines.append(f"{head} (ratio = this row / the peer's best setting in this run):")
        lines += [_line(v) for v in verdicts if v.get("source") == source]
    return "\n".join(lines)
