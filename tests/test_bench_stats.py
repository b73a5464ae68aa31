"""The benchmark's arithmetic: statistics, the workload, what a metric means, the targets files.

No timing is asserted anywhere: speed belongs in benchmark tables, never in tests.
A fake system with scripted durations checks that every metric is the median of the
per-run values, in the units the report says.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from polyengine.benchmarks import report, verdicts
from polyengine.benchmarks.phases import DecodeRun, ServeRun, run_long, run_standard
from polyengine.benchmarks.stats import median, percentile, rate, spread, summary
from polyengine.benchmarks.workload import QUICK, STANDARD, Workload, prompts, serve_requests


# -- stats -----------------------------------------------------------------------------------


def test_median_and_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 11):
        xs = rng.normal(size=n).tolist()
        assert median(xs) == pytest.approx(float(np.median(xs)))
        for q in (0, 10, 50, 90, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_median_of_even_count_is_the_mean_of_the_middle_two():
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5


def test_statistics_refuse_what_they_cannot_compute():
    with pytest.raises(ValueError):
        median([])
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    with pytest.raises(ValueError):
        median([1.0, float("nan")])
    with pytest.raises(ValueError):
        rate(10, 0.0)


def test_rate_spread_and_summary():
    assert rate(254, 2.0) == 127.0
    assert spread([9.0, 10.0, 12.0]) == pytest.approx(0.3)
    assert spread([5.0]) == 0.0
    s = summary([3.0, 1.0, 2.0])
    assert s["median"] == 2.0 and s["samples"] == [3.0, 1.0, 2.0] and s["spread"] == 1.0


# -- workload --------------------------------------------------------------------------------


def test_prompts_are_deterministic_distinct_and_ordinary_tokens():
    a = prompts(49152, 32, 128, phase="decode")
    assert a == prompts(49152, 32, 128, phase="decode")
    assert len({tuple(p) for p in a}) == 32 and all(len(p) == 128 for p in a)
    assert all(49152 // 4 <= t < 49152 // 2 for p in a for t in p)
    assert a != prompts(49152, 32, 128, phase="serve")  # phases never share prompts


def test_serve_requests_follow_the_workload():
    reqs = serve_requests(STANDARD, 49152)
    assert len(reqs) == STANDARD.serve_requests == 64
    lo, hi = STANDARD.serve_prompt_range
    assert all(lo <= len(r.prompt) <= hi for r in reqs)
    lo, hi = STANDARD.serve_new_range
    assert all(lo <= r.max_tokens <= hi for r in reqs)
    assert len({len(r.prompt) for r in reqs}) > 10, "lengths should be mixed"
    assert reqs == serve_requests(STANDARD, 49152)


def test_the_standard_workload_is_the_issues():
    w = STANDARD
    assert (w.prompt_len, w.new_tokens, w.batches, w.prefill_len) == (128, 128, (1, 8, 32), 1024)
    assert (w.serve_requests, w.long_batch, w.long_context) == (64, 32, 2048)
    assert Workload.from_dict(QUICK.to_dict()) == QUICK


# -- what a metric means -----------------------------------------------------------------------


class ScriptedSystem:
    """Durations chosen by hand: decode run i of batch b takes (i + 1) * b seconds."""

    vocab_size = 1000

    def __init__(self):
        self.calls: list[tuple[str, int, int]] = []

    def decode(self, ps, new_tokens, room=None):
        self.calls.append(("decode", len(ps), new_tokens))
        assert room in (None, 128)  # the warm-up is sized like the measured run
        i = sum(1 for c in self.calls if c[:2] == ("decode", len(ps))) - 2  # -1: warm-up
        seconds = (i + 1) * len(ps) if i >= 0 else 99.0
        steps = new_tokens - 1
        return DecodeRun(len(ps) * (new_tokens - 1), seconds, [seconds / steps] * steps, [len(ps)] * steps,
                         overhead_seconds=0.5, steps=new_tokens)

    def prefill(self, prompt):
        self.calls.append(("prefill", len(prompt), 0))
        return [99.0, 2.0, 1.0, 4.0][sum(1 for c in self.calls if c[0] == "prefill") - 1]

    def serve(self, requests, slots, sized_for=None):
        self.calls.append(("serve", len(requests), slots))
        assert sized_for is None or [len(r.prompt) + r.max_tokens for r in sized_for] == [
            len(r.prompt) + r.max_tokens for r in serve_requests(STANDARD, 1000)]
        total = sum(r.max_tokens for r in requests)
        return ServeRun(total, 10.0, ttfts=[0.1, 0.2, 0.3], overhead_seconds=2.0, steps=20)


def test_metrics_are_medians_of_per_run_values():
    work = STANDARD
    system = ScriptedSystem()
    partial: list[set] = []
    m = run_standard(system, work, repeats=3, emit=lambda *a: None, done=lambda x: partial.append(set(x)))
    assert len(partial) == len(work.batches) + 1 and "prefill_tok_s" in partial[-1]  # reported phase by phase
    # decode at batch b: runs take b, 2b, 3b seconds for b * 127 tokens -> median 127/2
    for b in work.batches:
        assert m["decode_tok_s"][str(b)]["median"] == pytest.approx(127 / 2)
        assert m["decode_overhead_s_per_step"][str(b)]["median"] == pytest.approx(0.5 / 128)
    # the warm-up ran first with warmup_tokens, and is never part of a metric
    assert ("decode", 1, work.warmup_tokens) in system.calls
    assert m["prefill_tok_s"]["median"] == pytest.approx(1024 / 2.0)  # runs 2, 1, 4 s
    total = sum(r.max_tokens for r in serve_requests(work, 1000))
    assert m["serve_e2e_tok_s"]["median"] == pytest.approx(total / 10.0)
    assert m["serve_ttft_p50_s"]["median"] == pytest.approx(0.2)
    assert m["driver_overhead_s_per_step"]["median"] == pytest.approx(0.1)


def test_long_rate_is_the_median_step_rate():
    class Long(ScriptedSystem):
        def decode(self, ps, new_tokens, room=None):
            steps = [5.0] + [0.5] * (new_tokens - 2)  # a slow first step (a compile) is ignored
            return DecodeRun(len(ps) * (new_tokens - 1), sum(steps), steps, [len(ps)] * len(steps))

    m = run_long(Long(), STANDARD, emit=lambda *a: None)
    assert m["long_decode_tok_s"]["median"] == pytest.approx(32 / 0.5)


# -- targets ---------------------------------------------------------------------------------


def _row(kind, name, decode1=None, decode32=None, prefill=None, dtype=None, options=None, quant=None, rss=None):
    metrics = {"decode_tok_s": {}}
    if decode1 is not None:
        metrics["decode_tok_s"]["1"] = {"median": decode1}
    if decode32 is not None:
        metrics["decode_tok_s"]["32"] = {"median": decode32}
    if prefill is not None:
        metrics["prefill_tok_s"] = {"median": prefill}
    if rss is not None:
        metrics["peak_rss_mib"] = rss  # a plain number, as cli.py stores it
    return {"row": name, "kind": kind, "system": kind, "setting": name, "metrics": metrics, "errors": {},
            "details": {"dtype": dtype} if dtype else {}, "params": {"options": options or {}, "quant": quant}}


B1 = "float32 decode b1 >= 80% of the bandwidth floor (or 3x transformers, the lower)"
INT8 = "int8 decode b1 >= llama.cpp Q4_1"
F16 = "best decode b32 >= llama.cpp F16"
HF32 = "best decode b32 >= 2x transformers"
PREFILL = "best prefill 1024 >= transformers' best"
RSS = "lowest peak RSS <= transformers' lowest"


def _by_target(verdicts):
    out = {}
    for v in verdicts:
        out.setdefault(v["target"], []).append(v)
    return out


TARGETS = Path(__file__).resolve().parents[1] / "benchmarks" / "targets"
ROUND2 = verdicts.load(TARGETS / "cpu-round2.toml")


def _judge(rows, work, limits=None):
    return verdicts.judge([ROUND2], rows, work, limits)


def test_the_projects_cpu_targets_are_sized_to_the_workload():
    assert [v["target"] for v in _judge([], STANDARD)] == [B1, INT8, F16, HF32, PREFILL, RSS]
    quick = [v["target"] for v in _judge([], QUICK)]
    assert quick[0].startswith("float32 decode b1 ") and quick[2] == "best decode b4 >= llama.cpp F16"
    assert quick[4] == f"best prefill {QUICK.prefill_len} >= transformers' best"
    assert ROUND2.title == "CPU speed, second round" and not ROUND2.within_row
    assert all(v["source"] == ROUND2.source for v in _judge([], STANDARD))


def test_a_json_targets_file_reads_as_its_toml_twin(tmp_path):
    import tomllib

    data = tomllib.loads((TARGETS / "cpu-round2.toml").read_text())
    (tmp_path / "round2.json").write_text(json.dumps(data))
    twin = verdicts.load(tmp_path / "round2.json")
    assert twin.compare == ROUND2.compare and twin.title == ROUND2.title


@pytest.mark.parametrize("body, message", [
    ('[[compare]]\nname = "x"\nmetric = "decode_tok_s.1"\npeer = "transformers"\nratio = 1\nspeed = 2',
     r"compare #1 \('x'\): unknown key\(s\) \['speed'\]"),
    ('[[compare]]\nname = "x"\nmetric = "decode_toks.1"\npeer = "transformers"\nratio = 1', "is no metric"),
    ('[[compare]]\nname = "x"\nmetric = "decode_tok_s.{batch}"\npeer = "transformers"\nratio = 1',
     r"names \['batch'\]; the workload fills in"),
    ('[[compare]]\nname = "x"\nmetric = "decode_tok_s.1"\npeer = "vllm"\nratio = 1', "peer must be one of"),
    ('[[compare]]\nname = "x"\nmetric = "decode_tok_s.1"\npeer = "transformers"', "missing ratio"),
    ('[[compare]]\nname = "x"\nmetric = "decode_tok_s.1"\npeer = "transformers"\nratio = -1',
     "ratio must be a positive number"),
    ('[[compare]]\nname = "x"\nmetric = "peak_rss_mib"\npeer = "transformers"\nratio = 1\nbetter = "lower"\n'
     'host_limit = "fp32_gemm_tok_s"', "drop host_limit"),
    ('[[within_row]]\nname = "x"\nmetric = "prefill_tok_s"\nbase = "prefill_tok_s"', "exactly one of at_most"),
    ('title = "nothing"', "no \\[\\[compare\\]\\] or \\[\\[within_row\\]\\] target"),
    ('[[compare]\nname = "x"', "not valid TOML"),
])
def test_a_malformed_targets_file_is_refused_with_what_is_wrong(tmp_path, body, message):
    from polyengine.errors import InvalidRequest

    path = tmp_path / "t.toml"
    path.write_text(body)
    with pytest.raises(InvalidRequest, match=message):
        verdicts.load(path)


def test_a_targets_file_must_be_toml_or_json_and_exist(tmp_path):
    from polyengine.errors import InvalidRequest

    (tmp_path / "t.yaml").write_text("x: 1")
    with pytest.raises(InvalidRequest, match="must end in .toml or .json"):
        verdicts.load(tmp_path / "t.yaml")
    with pytest.raises(InvalidRequest, match="targets file"):
        verdicts.load(tmp_path / "missing.toml")


def test_within_row_targets_and_a_peer_setting_by_dtype(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('''
[[compare]]
name = "prefill {prefill_len} >= 1.5x transformers float32"
metric = "prefill_tok_s"
peer = "transformers"
peer_setting = "float32"
ratio = 1.5

[[within_row]]
name = "serve with the cache >= 0.95x without"
metric = "prefix_serve_e2e_tok_s.cache"
base = "prefix_serve_e2e_tok_s.no_cache"
at_least = 0.95
''')
    mine = verdicts.load(path)
    ours = _row("polyengine", "pe", prefill=800)
    ours["metrics"]["prefix_serve_e2e_tok_s"] = {"cache": 96.0, "no_cache": 100.0}
    hf32 = _row("transformers", "hf fp32", prefill=500)
    hf32["params"]["dtype"] = "float32"
    hf16 = _row("transformers", "hf bf16", prefill=2000)
    hf16["params"]["dtype"] = "bfloat16"
    cmp, within = verdicts.judge([mine], [ours, hf32, hf16], STANDARD)
    assert cmp["target"] == "prefill 1024 >= 1.5x transformers float32" and cmp["peer_row"] == "hf fp32"
    assert cmp["needed"] == pytest.approx(750.0) and cmp["passed"]
    assert within["kind"] == "self" and within["ratio"] == pytest.approx(0.96) and within["passed"]
    text = verdicts.text([cmp, within], {mine.source: "mine"})
    assert text.splitlines()[0].startswith(f"targets from {mine.source} (mine)")
    assert "  serve with the cache >= 0.95x without [pe]: 96 / 100 = 0.960 -> PASS" in text


def test_targets_compare_with_the_peers_best_setting():
    rows = [
        _row("polyengine", "pe fp32", decode1=90, decode32=600, prefill=800, dtype="float32", rss=900),
        _row("polyengine", "pe int8", decode1=100, decode32=500, dtype="float32", options={"weights": "int8"}, rss=700),
        _row("transformers", "hf fp32", decode1=20, decode32=250, prefill=700, rss=1200),
        _row("transformers", "hf bf16", decode1=30, decode32=300, prefill=2000, rss=800),
        _row("llamacpp", "llama Q4_1", decode1=95, decode32=700, quant="Q4_1", rss=300),
        _row("llamacpp", "llama F16", decode1=50, decode32=600, quant="F16"),
    ]
    got = _by_target(_judge(rows, STANDARD))
    (b1,) = got[B1]  # int8 rows are not float32 rows
    assert b1["row"] == "pe fp32" and b1["peer_row"] == "hf bf16" and b1["ratio"] == pytest.approx(3.0)
    assert b1["needed"] == pytest.approx(90.0) and b1["passed"] and "limit" not in b1
    (int8,) = got[INT8]
    assert int8["row"] == "pe int8" and int8["peer_row"] == "llama Q4_1" and int8["passed"]
    (f16,) = got[F16]  # the best b32 row only; llama.cpp's Q4_1 (700) is not its peer
    assert f16["row"] == "pe fp32" and f16["best_of"] == ["pe fp32", "pe int8"]
    assert f16["peer_row"] == "llama F16" and f16["ratio"] == pytest.approx(1.0) and f16["passed"], "at least"
    (hf32,) = got[HF32]
    assert hf32["row"] == "pe fp32" and hf32["peer_row"] == "hf bf16" and hf32["needed"] == pytest.approx(600.0)
    assert hf32["passed"]
    (pre,) = got[PREFILL]
    assert pre["best_of"] == ["pe fp32"] and pre["peer_row"] == "hf bf16" and not pre["passed"]
    (rss,) = got[RSS]  # llama.cpp's 300 MiB is no peer of this target
    assert rss["row"] == "pe int8" and rss["peer_row"] == "hf bf16" and rss["ratio"] == pytest.approx(0.875)
    assert rss["passed"] and rss["best_of"] == ["pe fp32", "pe int8"]


def test_bfloat16_weight_rows_are_not_judged_as_float32():
    """A ``weight_dtype: bfloat16`` row computes in float32 but streams half the bytes."""
    bf16 = _row("polyengine", "pe bf16 weights", decode1=80, decode32=900, dtype="float32",
                options={"weight_dtype": "bfloat16", "bf16_compute": "bf16"})
    rows = [
        _row("polyengine", "pe fp32", decode1=50, decode32=300, dtype="float32"),
        _row("polyengine", "pe fp32 asked", decode1=50, dtype="float32", options={"weight_dtype": "float32"}),
        _row("polyengine", "pe auto", decode1=50, dtype="float32", options={"weight_dtype": "auto"}),
        _row("polyengine", "pe bf16", decode1=50, dtype="bfloat16"),
        bf16,
        _row("transformers", "hf", decode1=10, decode32=100),
    ]
    got = _by_target(_judge(rows, STANDARD))
    assert {v["row"] for v in got[B1]} == {"pe fp32", "pe fp32 asked", "pe auto"}
    assert got[HF32][0]["row"] == "pe bf16 weights", "the best-row targets judge any dtype"
    (alone,) = _by_target(_judge([bf16, rows[-1]], STANDARD))[B1]
    assert alone == {"target": B1, "row": None, "verdict": "no polyengine row in this run applies",
                     "source": ROUND2.source}


def test_the_best_row_targets_judge_only_the_best_row():
    rows = [
        _row("polyengine", "pe slow", decode32=300, prefill=100, rss=500),
        _row("polyengine", "pe fast", decode32=500, prefill=900, rss=900),
        _row("polyengine", "pe none"),  # no values: not among those compared
        _row("transformers", "hf", decode32=200, prefill=800, rss=600),
        _row("llamacpp", "llama F16", decode32=450, quant="F16"),
    ]
    judged = _judge(rows, STANDARD)
    got = _by_target(judged)
    for name, row in ((F16, "pe fast"), (HF32, "pe fast"), (PREFILL, "pe fast"), (RSS, "pe slow")):
        (v,) = got[name]
        assert v["row"] == row and v["passed"], name
        assert v["best_of"] == ["pe slow", "pe fast"], name
    assert not any(v["row"] == "pe slow" for name in (F16, HF32, PREFILL) for v in got[name]), \
        "the weaker row would fail; it is not judged"
    nothing = _by_target(_judge([rows[2], *rows[3:]], STANDARD))
    assert nothing[F16] == [{"target": F16, "row": None, "verdict": "not judged: no polyengine row has this value",
                             "source": ROUND2.source}]
    text = verdicts.text(judged)
    assert f"  {F16} [pe fast, best of 2]: 500 / 450 (llama F16) = 1.11x; asked at least 450 = 1x the peer -> PASS" \
        in text


def test_peak_rss_is_lower_is_better():
    hf = [_row("transformers", "hf fp32", rss=1200.0), _row("transformers", "hf bf16", rss=750.0)]

    def rss(*ours):
        rows = [_row("polyengine", f"pe {i}", rss=m) for i, m in enumerate(ours)] + hf
        (v,) = _by_target(_judge(rows, STANDARD))[RSS]
        return v

    v = rss(900.0, 700.0)
    assert v["row"] == "pe 1" and v["peer_row"] == "hf bf16" and v["needed"] == 750.0 and v["passed"]
    assert v["lower_is_better"] and v["ratio"] == pytest.approx(700 / 750)
    v = rss(800.0, 900.0)  # above transformers' lowest, though below its highest
    assert v["row"] == "pe 0" and v["peer_value"] == 750.0 and not v["passed"] and v["verdict"] == "FAIL"
    assert rss(750.0)["passed"], "equal is at most"
    text = verdicts.text([rss(800.0)])
    assert "800 / 750 (hf bf16) = 1.07x; asked at most 750 = 1x the peer -> FAIL" in text


def test_the_f16_target_ignores_q4_1_and_f32_rows():
    ours = _row("polyengine", "pe", decode32=500)
    rows = [ours, _row("llamacpp", "llama Q4_1", decode32=1000, quant="Q4_1"),
            _row("llamacpp", "llama F32", decode32=900, quant="F32"),
            _row("llamacpp", "llama F16 1 thread", decode32=300, quant="F16"),
            _row("llamacpp", "llama F16 2 threads", decode32=400, quant="F16")]
    (v,) = _by_target(_judge(rows, STANDARD))[F16]
    assert v["peer_row"] == "llama F16 2 threads" and v["ratio"] == pytest.approx(1.25) and v["passed"]
    (v,) = _by_target(_judge(rows[:3], STANDARD))[F16]
    assert v["verdict"] == "not judged: no llamacpp row has this value" and "passed" not in v


def test_a_target_past_the_host_limit_asks_for_80_percent_of_it():
    rows = [
        _row("polyengine", "pe fp32", decode1=45, decode32=370, dtype="float32"),
        _row("transformers", "hf bf16", decode1=24, decode32=200),
        _row("llamacpp", "llama F16", decode32=400, quant="F16"),
    ]
    limits = {"fp32_b1_floor_tok_s": 55.0, "fp32_gemm_tok_s": 450.0}
    got = {v["target"]: v for v in _judge(rows, STANDARD, limits)}
    b1 = got[B1]  # 3 x 24 = 72 > 0.8 x 55 = 44: asks 44
    assert b1["needed"] == pytest.approx(44.0) and b1["passed"] and b1["limit"] == 55.0
    assert b1["limit_name"] == "fp32_b1_floor_tok_s" and b1["peer_row"] == "hf bf16"
    b32 = got[HF32]  # 2 x 200 = 400 > 0.8 x 450 = 360
    assert b32["needed"] == pytest.approx(360.0) and b32["passed"] and b32["limit_name"] == "fp32_gemm_tok_s"
    f16 = got[F16]  # llama.cpp's measured value is within the host's reach: not capped
    assert f16["needed"] == pytest.approx(400.0) and not f16["passed"] and "limit" not in f16
    plain = {v["target"]: v for v in _judge(rows, STANDARD)}
    assert not plain[B1]["passed"] and plain[B1]["needed"] == pytest.approx(72.0), "without limits 3x decides"
    low = _judge(rows, STANDARD, {"fp32_b1_floor_tok_s": 500.0, "fp32_gemm_tok_s": 5000.0})
    assert all("limit" not in v for v in low), "a limit above what the ratio asks changes nothing"
    text = verdicts.text([b1])
    assert "45.0 / 24.0 (hf bf16) = 1.88x; asked at least 44.0 = 80% of 55.0 (fp32_b1_floor_tok_s) -> PASS" in text


def test_the_float32_target_without_transformers_asks_80_percent_of_the_floor():
    rows = [_row("polyengine", "pe fast", decode1=45, decode32=400, dtype="float32"),
            _row("polyengine", "pe slow", decode1=40, dtype="float32")]
    limits = {"fp32_b1_floor_tok_s": 55.0, "fp32_gemm_tok_s": 450.0}
    got = _by_target(_judge(rows, STANDARD, limits))
    fast, slow = got[B1]
    assert fast["needed"] == pytest.approx(44.0) and fast["passed"] and fast["limit"] == 55.0
    assert fast["peer_row"] is None and fast["peer_value"] is None and fast["ratio"] is None
    assert slow["needed"] == pytest.approx(44.0) and not slow["passed"]
    (hf32,) = got[HF32]  # 2x transformers needs transformers: its limit only caps
    assert hf32["verdict"] == "not judged: no transformers row has this value" and "passed" not in hf32
    text = verdicts.text(got[B1])
    assert f"  {B1} [pe fast]: 45.0, no peer value; asked at least 44.0 = 80% of 55.0 (fp32_b1_floor_tok_s) -> PASS" \
        in text
    (none,) = _by_target(_judge(rows[:1], STANDARD))[B1]
    assert none["verdict"] == ("not judged: no transformers row has this value and the host limit "
                               "fp32_b1_floor_tok_s was not measured")


def test_a_row_is_judged_by_the_bandwidth_probed_around_it():
    """The float32 floor of a row with read probes of its own is the mean of them (the
    run-start probe can be far off on a shared host); its share of the floor too."""
    limits = {"read_gb_s": 56.0, "fp32_b1_floor_tok_s": 104.0, "fp32_gemm_tok_s": 450.0,
              "weight_bytes": {"float32": 4 * 134.5e6}}
    row = _row("polyengine", "pe fp32", decode1=58.8, dtype="float32")
    hf = _row("transformers", "hf bf16", decode1=24.6)
    (before,) = _by_target(_judge([row, hf], STANDARD, limits))[B1]
    assert before["needed"] == pytest.approx(3 * 24.6) and not before["passed"]
    row["read_probes_gb_s"] = [36.0, 38.0]
    (v,) = _by_target(_judge([row, hf], STANDARD, limits))[B1]
    assert v["limit"] == pytest.approx(104.0 * 37 / 56) and v["needed"] == pytest.approx(0.8 * 104.0 * 37 / 56)
    assert v["passed"] and v["read_probes_gb_s"] == [36.0, 38.0]
    assert "read 36.0 / 38.0 GB/s right before / after the row -> PASS" in verdicts.text([v])
    assert report.reached(row, STANDARD, limits)["b1_of_bandwidth_floor"] == pytest.approx(58.8 * 4 * 134.5e6 / 37e9)
    row["read_probes_gb_s"] = [None, 40.0]  # a probe that failed counts for nothing
    (v,) = _by_target(_judge([row, hf], STANDARD, limits))[B1]
    assert v["limit"] == pytest.approx(104.0 * 40 / 56)


def test_the_run_probes_bandwidth_right_before_and_after_each_polyengine_row(monkeypatch):
    """One probe between two rows serves both; a peer row's probes are kept apart (they
    set no polyengine row's limits) and, with the others, tell whether the host's read
    rate drifted during the run: a note then says so."""
    import argparse

    from polyengine.benchmarks import cli, limits
    from polyengine.benchmarks.jobs import Job

    events: list[str] = []
    reads = iter([50.0, 37.0, 36.0, 39.0, 38.0])
    monkeypatch.setattr(limits, "measure", lambda model, batch, env=None: events.append("limits") or {
        "read_gb_s": 50.0, "fp32_b1_floor_tok_s": 90.0, "fp32_gemm_tok_s": 400.0, "weight_bytes": {}})
    monkeypatch.setattr(limits, "measure_read", lambda env=None: events.append("read") or next(reads))
    jobs = [Job(f"{kind} {i}", kind, {}, "standard", parts=["standard"])
            for i, kind in enumerate(["polyengine", "polyengine", "transformers", "polyengine"])]
    monkeypatch.setattr(cli, "plan", lambda args, notes: jobs)

    def run_row(job, work, repeats, timeout, progress):
        events.append(job.row)
        return _row(job.kind, job.row, decode1=50, dtype="float32")

    monkeypatch.setattr(cli, "_run_row", run_row)
    args = argparse.Namespace(quick=False, repeats=1, timeout=None, parts="standard", isa=None, model="random:tiny",
                              json=None)
    doc = cli.run(args)
    assert events == ["limits", "polyengine 0", "read", "polyengine 1", "read", "transformers 2", "read",
                      "polyengine 3", "read"]
    assert [r.get("read_probes_gb_s") for r in doc["rows"]] == [[50.0, 50.0], [50.0, 37.0], None, [36.0, 39.0]]
    assert doc["rows"][2]["peer_read_probes_gb_s"] == [37.0, 36.0]
    assert any("moved between 36.0 and 50.0 GB/s during this run" in n for n in doc["notes"])


def test_a_drift_note_only_where_the_probes_moved_by_a_fifth():
    from polyengine.benchmarks import limits

    rows = [{"read_probes_gb_s": [30.0, 33.0]}, {"peer_read_probes_gb_s": [33.0, None]}]
    assert limits.drift({"read_gb_s": 31.0}, rows) is None  # 33 / 30 = 1.1
    note = limits.drift({"read_gb_s": 31.0}, rows + [{"peer_read_probes_gb_s": [33.0, 36.0]}])
    assert note and "between 30.0 and 36.0 GB/s" in note and "alternating.py" in note
    assert limits.drift(None, [{"read_probes_gb_s": [None, 40.0]}]) is None  # one probe: nothing to compare
    assert limits.drift({"error": "no torch"}, []) is None


def test_each_row_reports_its_isa_and_share_of_the_host_limits():
    """b1 over the bandwidth floor of the bytes the row streams (its int8 mode's copies,
    else its weight_dtype's or its dtype's), b32 and prefill over torch's GEMM rate; none
    without limits."""
    limits = {"read_gb_s": 20.0, "fp32_gemm_tok_s": 400.0,
              "weight_bytes": {"float32": 4e8, "bfloat16": 2e8, "int8": 1.1e8}}
    fp32 = _row("polyengine", "pe fp32", decode1=40, decode32=300, prefill=800, dtype="float32")
    fp32["details"]["paths"] = {"isa": "avx2 (forced by option isa, -march=haswell)"}
    int8 = _row("polyengine", "pe int8", decode1=90, dtype="float32", options={"quantize": "int8", "isa": "scalar"})
    assert report.isa(fp32) == "avx2" and report.isa(int8) is None
    assert report.reached(fp32, STANDARD, limits) == pytest.approx(
        {"b1_of_bandwidth_floor": 40 * 4e8 / 20e9, "b32_of_torch_gemm": 0.75, "prefill_of_torch_gemm": 2.0})
    assert report.reached(int8, STANDARD, limits) == pytest.approx({"b1_of_bandwidth_floor": 90 * 1.1e8 / 20e9})
    bf16 = _row("polyengine", "pe bf16", decode1=80, dtype="float32", options={"weight_dtype": "bfloat16"})
    assert report.reached(bf16, STANDARD, limits) == pytest.approx({"b1_of_bandwidth_floor": 80 * 2e8 / 20e9})
    assert report.reached(fp32, STANDARD, None) is None and report.reached(fp32, STANDARD, {"error": "x"}) is None
    fp32.update(isa="avx2", limits_reached=report.reached(fp32, STANDARD, limits))
    head, _, line = report.table([fp32], STANDARD).splitlines()
    assert "| ISA " in head and "of host limits b1/b32/prefill" in head
    assert "| avx2 " in line and "0.80 / 0.75 / 2.00 |" in line


def test_isa_rows_are_expanded_and_checked_before_any_job(monkeypatch):
    """``--isa``: each path a row of its own (the cpu backend only); 'all' every forced path
    this CPU runs; a path it cannot run, or an ISA chosen twice, is refused up front."""
    import argparse

    from polyengine.benchmarks import cli
    from polyengine.errors import InvalidRequest

    monkeypatch.setattr("polyengine.hostinfo.runnable_isas", lambda: ("avx2", "scalar"))
    monkeypatch.setattr("polyengine.hostinfo.missing_for", lambda isa: ("avx512f",) if isa == "avx512" else ())
    assert cli._isas(None) == [None]
    assert cli._isas("auto,all,scalar") == ["auto", "avx2", "scalar"]
    with pytest.raises(InvalidRequest, match=r"lacks avx512f\); it runs avx2, scalar"):
        cli._isas("avx512")
    with pytest.raises(InvalidRequest, match="'neon' is no ISA path"):
        cli._isas("neon")
    with pytest.raises(InvalidRequest, match="give one of them"):
        cli._with_isas([{"isa": "avx2"}], ["scalar"], "cpu")

    def plan(backend, isa):
        args = argparse.Namespace(backend=[backend], dtype=[None], options=['{"quantize": "int8"}'], isa=isa,
                                  peers="none", model="random:tiny", cache_dir=None)
        notes: list[str] = []
        return [job.params["options"] for job in cli.plan(args, notes)], notes

    assert plan("cpu", "all")[0] == [{"quantize": "int8", "isa": "avx2"}, {"quantize": "int8", "isa": "scalar"}]
    options, notes = plan("reference", "all")
    assert options == [{"quantize": "int8"}] and "--isa not applied" in notes[0]


def test_targets_say_why_they_were_not_judged():
    rows = [_row("polyengine", "pe f64", decode1=10, prefill=100, dtype="float64", rss=300)]
    judged = _judge(rows, STANDARD)
    text = {v["target"]: v["verdict"] for v in judged}
    assert set(text) == {B1, INT8, F16, HF32, PREFILL, RSS}
    assert text[B1] == text[INT8] == "no polyengine row in this run applies"
    assert text[F16] == text[HF32] == "not judged: no polyengine row has this value"
    assert text[PREFILL] == "not judged: no transformers row has this value"
    assert text[RSS] == "not judged: no transformers row has this value"
    rendered = verdicts.text(judged)
    assert f"  {PREFILL} [pe f64]: not judged: no transformers row has this value" in rendered


def test_int8_rows_are_recognised_by_their_options():
    assert verdicts.is_int8({"weights": "int8"}) and verdicts.is_int8({"int8_weights": True})
    assert not verdicts.is_int8({}) and not verdicts.is_int8({"weights": "float32"})


def test_llamacpp_build_flags_follow_the_detected_isa():
    from polyengine.benchmarks.host import llamacpp_install_command

    zen3 = llamacpp_install_command({"isa": ["avx2", "fma", "f16c"]})
    assert "-DGGML_NATIVE=OFF" in zen3 and "-DGGML_AVX2=ON" in zen3 and "AVX512" not in zen3
    sapphire = llamacpp_install_command({"isa": ["avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"]})
    assert all(f"-D{o}=ON" in sapphire for o in ("GGML_AVX512", "GGML_AVX512_BF16", "GGML_AMX_INT8", "GGML_AMX_BF16"))
    assert llamacpp_install_command({"isa": ["asimd"]}) == "pip install llama-cpp-python"


def test_progress_is_one_live_line_on_a_terminal_and_plain_lines_otherwise():
    import io

    from polyengine.benchmarks.progress import Progress

    live, plain = io.StringIO(), io.StringIO()
    for stream, is_live in ((live, True), (plain, False)):
        p = Progress(2, stream=stream, live=is_live)
        p.start_job("polyengine reference (standard)")
        p.event("decode b1", "run 1/3")
        p.end_job()
        p.start_job("transformers fp32 (standard)")
        p.end_job("boom")
    assert "\r\x1b[2K" in live.getvalue() and live.getvalue().count("\n") == 2  # one kept line per job
    lines = plain.getvalue().splitlines()
    assert "\r" not in plain.getvalue() and len(lines) == 5
    assert lines[1].startswith("[1/2] polyengine reference (standard): decode b1, run 1/3")
    assert "FAILED: boom" in lines[-1]


def test_the_scale_workload_runs_the_phases_asked_for_and_reports_load_time():
    """``--workload scale --parts decode,prefill`` (benchmarks/scripts/llama_shapes.py's
    run): batch 1 and 8 of 32 tokens after 128, a 512-token prefill, no serve; the table
    keeps the columns of what ran, with the load time."""
    import argparse

    from polyengine.benchmarks import cli
    from polyengine.benchmarks.workload import SCALE
    from polyengine.errors import InvalidRequest

    assert (SCALE.prompt_len, SCALE.new_tokens, SCALE.batches, SCALE.prefill_len) == (128, 32, (1, 8), 512)
    assert cli._parts("prefill,decode") == (["standard"], ("decode", "prefill"))
    assert cli._parts("standard,long,decode") == (["standard", "long"], ("decode", "prefill", "serve"))
    assert cli._parts("long") == (["long"], ())
    with pytest.raises(InvalidRequest, match="phases"):
        cli._parts("decode,serving")
    assert cli._workload(argparse.Namespace(quick=False, workload="scale")) is SCALE
    with pytest.raises(InvalidRequest, match="--quick runs the tiny workload"):
        cli._workload(argparse.Namespace(quick=True, workload="scale"))

    class Scaled(ScriptedSystem):
        def decode(self, ps, new_tokens, room=None):
            self.calls.append(("decode", len(ps), new_tokens))
            return DecodeRun(len(ps) * (new_tokens - 1), 2.0)

    system = Scaled()
    m = run_standard(system, SCALE, repeats=1, emit=lambda *a: None, phases=("decode", "prefill"))
    assert set(m) == {"decode_tok_s", "decode_overhead_s_per_step", "prefill_tok_s"}
    assert {c for c in system.calls if c[0] != "prefill"} == {("decode", 1, 16), ("decode", 1, 32), ("decode", 8, 16),
                                                             ("decode", 8, 32)}
    assert m["decode_tok_s"]["8"]["median"] == pytest.approx(8 * 31 / 2.0)
    assert {c[1] for c in system.calls if c[0] == "prefill"} == {512}
    row = _row("polyengine", "pe", decode1=10.0, prefill=50.0, rss=900.0)
    row["metrics"]["load_s"] = 3.25
    head, _, line = report.table([row], SCALE, ran=["standard", "decode", "prefill"]).splitlines()
    assert "decode b8 tok/s" in head and "prefill 512 tok/s" in head and "load s" in head
    assert "serve" not in head and "b32x2048" not in head and "host limits" not in head
    assert line.endswith(" 900 |    3.2 |")  # peak RSS, then the load time
    assert "serve64 e2e tok/s" in report.table([row], SCALE).splitlines()[0]  # no parts given: every column


def test_a_file_in_blocks_is_judged_against_the_floor_of_its_stored_bytes():
    """stored_b1_floor_tok_s (bandwidth / the bytes of the file's tensors a step reads)
    caps a quantized target at 80% of it, follows the row's own read probes as the
    float32 floor does, and is the b1 share of a row on a file stored under 16 bits."""
    quantized = verdicts.load(TARGETS / "quantized.toml")  # the project's file: its b1 target names the limit

    def b1(rows, limits):
        (v,) = [e for e in verdicts.judge([quantized], rows, STANDARD, limits)
                if e["target"] == "decode b1 >= llama.cpp's" and e["row"] == "pe"]
        return v

    rows = [_row("polyengine", "pe", decode1=30, dtype="float32"), _row("llamacpp", "llama", decode1=43)]
    limits = {"read_gb_s": 30.0, "stored_b1_floor_tok_s": 45.0, "fp32_gemm_tok_s": 40.0,
              "weight_bytes": {"float32": 4e9, "float16": 2e9, "stored": 30e9 / 45.0}}
    v = b1(rows, limits)  # 1.0 x 43 > 0.8 x 45 = 36: asks 36
    assert v["needed"] == pytest.approx(36.0) and v["limit_name"] == "stored_b1_floor_tok_s" and not v["passed"]
    assert b1(rows, None)["needed"] == pytest.approx(43.0), "without limits the ratio alone decides"
    rows[0]["read_probes_gb_s"] = [20.0, 20.0]  # a slower minute: the floor follows it (30 -> 20 GB/s)
    v = b1(rows, limits)
    assert v["limit"] == pytest.approx(30.0) and v["needed"] == pytest.approx(24.0) and v["passed"]
    assert v["read_probes_gb_s"] == [20.0, 20.0]
    del rows[0]["read_probes_gb_s"]
    got = report.reached(rows[0], STANDARD, limits)
    assert got["b1_of_stored_floor"] == pytest.approx(30 / 45.0)
    wide = {**limits, "weight_bytes": {**limits["weight_bytes"], "stored": 4e9}}  # a float32 file: no such share
    assert "b1_of_stored_floor" not in report.reached(rows[0], STANDARD, wide)
    rows[0]["limits_reached"] = got
    assert f"{30 / 45.0:.2f} / - / -" in report.table(rows[:1], STANDARD)
    line = report.limits_line({"host": {"limits": {**limits, "fp32_b1_floor_tok_s": 7.5, "params": 1e9,
                                                   "gemm_gflop_s": 80.0, "gemm_shape": [8, 2048, 8192]}}})
    assert "the file's tensors as stored 45 tok/s (667 MB a step)" in line


# -- bytecode before the workers load -----------------------------------------------------------


def test_the_bench_compiles_every_package_folder_of_pyproject():
    """host.SOURCE_ROOTS names pyproject.toml's package-dir roots: every folder an
    editable install maps is compiled before the workers time their load."""
    import tomllib

    from polyengine.benchmarks import host

    data = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert set(host.SOURCE_ROOTS) == set(data["tool"]["setuptools"]["package-dir"])


def test_compile_bytecode_writes_what_is_missing_once(tmp_path, monkeypatch):
    import sys
    from importlib.util import cache_from_source

    from polyengine.benchmarks import host

    package = tmp_path / "bytecode_probe_pkg"
    (package / "sub").mkdir(parents=True)
    for path in (package / "__init__.py", package / "a.py", package / "sub" / "__init__.py", package / "sub" / "b.py"):
        path.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(host, "SOURCE_ROOTS", ("bytecode_probe_pkg", "bytecode_probe_pkg.sub", "no_such_package_here"))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # as under PYTHONDONTWRITEBYTECODE=1
    first = host.compile_bytecode()
    assert first["folders"] == [str(package)] and (first["compiled"], first["missing"]) == (4, 0)
    assert Path(cache_from_source(str(package / "sub" / "b.py"))).is_file()
    assert host.compile_bytecode()["compiled"] == 0
