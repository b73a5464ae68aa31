"""`polyengine bench` end to end on the reference backend, its workers, and its peers' plumbing.

What these check is what the report claims (the documented fields, token counts, which
run a number came from), never how fast anything is.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from polyengine.benchmarks.jobs import Job, run_job
from polyengine.benchmarks.workload import QUICK, STANDARD, Request

from imports import assert_imports_light

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ROOT / "benchmarks" / "targets"


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("polyengine")
    return [str(script)] if script.exists() else [sys.executable, "-m", "polyengine.cli"]


def _bench(args: list[str], cwd: Path) -> tuple[int, str, str]:
    proc = subprocess.run([*_cli(), "bench", *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def test_no_heavy_imports_and_the_core_does_not_import_the_benchmarks():
    code = textwrap.dedent("""
        import sys
        import polyengine, polyengine.cli
        polyengine.cli.build_parser()
        import polyengine.benchmarks.cli, polyengine.benchmarks.jobs, polyengine.benchmarks.report
        import polyengine.benchmarks.worker, polyengine.benchmarks.run_polyengine
        import polyengine.benchmarks.run_transformers, polyengine.benchmarks.run_llamacpp
        import polyengine.benchmarks.gguf_convert, polyengine.benchmarks.host
    """)
    assert_imports_light(code, heavy=("torch", "transformers", "llama_cpp", "jax"))
    for path in (ROOT / "core").rglob("*.py"):
        assert "polyengine.benchmarks" not in path.read_text(encoding="utf-8"), f"{path} imports the benchmarks"


def test_polyengine_system_counts_what_it_reports():
    from polyengine.benchmarks.run_polyengine import PolyengineSystem

    system = PolyengineSystem(model="random:tiny", backend="reference", dtype="float32", options={})
    run = system.decode([[40, 41, 42], [50, 51, 52]], 5)
    assert run.decode_tokens == 2 * 4
    assert len(run.step_seconds) == len(run.step_tokens) == run.steps - 1
    assert run.decode_seconds > 0 and run.overhead_seconds >= 0
    engine = system.llm(2, 3, 8).engine
    assert engine.seconds > 0 and engine.name == "reference"  # the wrapper forwards attributes
    reqs = [Request([40 + i] * (3 + i), 2 + i) for i in range(5)]
    served = system.serve(reqs, slots=2)
    assert served.completion_tokens == sum(r.max_tokens for r in reqs)
    assert len(served.ttfts) == 5 and all(t > 0 for t in served.ttfts)
    assert served.steps >= max(r.max_tokens for r in reqs)
    assert system.prefill(list(range(40, 60))) > 0
    assert system.description["dtype"] == "float32" and system.description["backend"] == "reference"


def test_engine_builds_carry_the_engines_bench_report(monkeypatch):
    """An engine's optional ``bench_report()`` (compile rows, stats) reaches the report,
    refreshed after each run; a report that raises is recorded, not fatal."""
    from polyengine.backends.reference.engine import ReferenceEngine
    from polyengine.benchmarks.report import builds
    from polyengine.benchmarks.run_polyengine import PolyengineSystem

    calls = []

    def bench_report(self):
        calls.append(1)
        return {"compile": [{"program": "prefill", "bucket": "16", "seconds": 1.5, "source": "compiled"},
                            {"program": "generate", "bucket": "b2", "seconds": 0.01, "source": "cache"}],
                "acceptance": len(calls) / 10}

    monkeypatch.setattr(ReferenceEngine, "bench_report", bench_report, raising=False)
    system = PolyengineSystem(model="random:tiny", backend="reference", dtype="float32", options={})
    system.decode([[40, 41, 42]], 3)
    (build,) = system.description["engine_builds"]
    assert build["shape"] == [1, 3, 6] and build["seconds"] > 0
    assert build["acceptance"] == 0.2 and len(build["compile"]) == 2  # refreshed after the run
    (line,) = builds([{"row": "reference float32", "details": system.description}])
    assert "compiled 1 (1.5 s): prefill[16] 1.5 s" in line and "from cache 1" in line and "acceptance: 0.2" in line

    monkeypatch.setattr(ReferenceEngine, "bench_report", lambda self: 1 / 0, raising=False)
    system = PolyengineSystem(model="random:tiny", backend="reference", dtype="float32", options={})
    system.decode([[40, 41, 42]], 3)
    assert "ZeroDivisionError" in system.description["engine_builds"][0]["report_error"]


def test_timed_engine_counts_the_first_result_read_as_engine_time():
    import polyengine
    from polyengine import SamplingParams
    from polyengine.benchmarks.run_polyengine import TimedEngine

    engine = TimedEngine(polyengine.create_engine("reference", model="random:tiny", config=dict(max_slots=1, max_cache_length=16)))
    params = engine.load_params()
    prefix, first = engine.prefill(params=params, tokens=[40, 41], sampling=SamplingParams(temperature=0))
    before = engine.seconds
    assert engine.admitted_at == 0.0
    token = int(first.tokens[0, 0])
    assert engine.seconds >= before and engine.admitted_at > 0
    assert first.row_tokens(0) == [token]  # other attributes reach the real result


def test_timed_engine_counts_a_batched_prefill_as_engine_time():
    """The driver's prefill on an engine declaring batched_prefill is ``prefill_batch``:
    timed as engine work (not driver overhead), each first token's read too."""
    import polyengine
    from polyengine import SamplingParams
    from polyengine.benchmarks.run_polyengine import TimedEngine
    from polyengine.engine import PrefillRequest

    engine = TimedEngine(polyengine.create_engine("cpu", model="random:tiny", config=dict(max_slots=2, max_cache_length=16)))
    assert engine.capabilities.batched_prefill
    params = engine.load_params()
    before = engine.seconds
    done = engine.prefill_batch(params=params, requests=[
        PrefillRequest(tokens=[40, 41], sampling=SamplingParams(temperature=0)),
        PrefillRequest(tokens=[42], sampling=SamplingParams(temperature=0))])
    assert engine.seconds > before and engine.admitted_at == 0.0
    assert [prefix.true_length for prefix, _ in done] == [2, 1]
    int(done[1][1].tokens[0, 0])
    assert engine.admitted_at > 0


def _check_quick_report(doc: dict, stdout: str, stderr: str, backend: str = "reference", dtype: str = "float64") -> None:
    assert doc["schema"] == "polyengine-bench/1" and doc["repeats"] == 1
    assert doc["workload"]["name"] == "quick"
    assert doc["host"]["cpu"]["model"] and isinstance(doc["host"]["cpu"]["isa"], list)
    assert "load_start" in doc["host"] and "versions" in doc["host"]
    (row,) = doc["rows"]  # --quick runs no peer unless --peers names it (transformers is installed here)
    assert row["kind"] == "polyengine" and row["errors"] == {}
    assert row["details"]["backend"] == backend and row["details"]["dtype"] == dtype
    m = row["metrics"]
    assert set(m["decode_tok_s"]) == {str(b) for b in QUICK.batches}
    for key in ("prefill_tok_s", "serve_e2e_tok_s", "serve_ttft_p50_s", "driver_overhead_s_per_step", "long_decode_tok_s"):
        assert m[key]["median"] > 0 and len(m[key]["samples"]) >= 1, key
    assert m["peak_rss_mib"] > 10 and m["long_peak_rss_mib"] > 10
    # no targets asked for: nothing judged, no verdict lines, no internal wording
    assert doc["targets"] == [] and doc["targets_from"] == []
    for word in ("PASS", "FAIL", "targets", "issue", "stop 3"):
        assert word not in stdout, word
    # the table: CPU line, one row, the columns named after the workload
    assert "ISA:" in stdout and "decode b1 tok/s" in stdout and "b4x96 RSS MiB" in stdout
    assert f"| polyengine | {backend} {dtype}" in stdout
    assert "[2/2]" in stderr  # progress, as plain lines when not on a terminal


def test_quick_bench_writes_the_documented_fields(tmp_path):
    """The tiny random preset keeps this fast; the default model goes the same way (below)."""
    out = tmp_path / "out.json"
    code, stdout, stderr = _bench(["--quick", "--backend", "reference", "--model", "random:tiny", "--json", str(out)],
                                  tmp_path)
    assert code == 0, stdout + stderr
    _check_quick_report(json.loads(out.read_text()), stdout, stderr)


@pytest.mark.slow
def test_quick_bench_on_the_default_model(tmp_path, default_gguf):
    """The documented smoke check as a user types it: ``polyengine bench --quick`` (the
    default backend, cpu on this host, the default model, no peer). Its time is printed,
    not asserted (no test judges speed); the help promises under a minute."""
    import time

    out = tmp_path / "out.json"
    start = time.perf_counter()
    code, stdout, stderr = _bench(["--quick", "--json", str(out)], tmp_path)
    print(f"polyengine bench --quick: {time.perf_counter() - start:.1f} s")
    assert code == 0, stdout + stderr
    _check_quick_report(json.loads(out.read_text()), stdout, stderr, backend="cpu", dtype="float32")


def _workers_of_this_process() -> list[int]:
    """The pids of this process's benchmark workers (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmd = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"polyengine.benchmarks.worker" in cmd:
            found.append(int(entry))
    return found


def test_a_worker_stopped_by_a_signal_is_reported_by_the_signals_name_and_usual_cause():
    import signal

    def stop(phase, detail):
        if phase == "load":
            for pid in _workers_of_this_process():
                os.kill(pid, signal.SIGTERM)

    slow = Job("slow", "polyengine", dict(model="random:tiny", backend="reference", dtype=None, options={}), "standard")
    res = run_job(slow, workload=QUICK.to_dict(), repeats=10**6, timeout=120, on_progress=stop)
    assert res["event"] == "error" and "SIGTERM" in res["error"], res["error"]
    assert "out of memory" not in res["error"]  # a SIGKILL may be the OOM killer; a SIGTERM is not


def test_a_failing_worker_becomes_an_error_and_a_slow_one_is_stopped():
    work, seen = QUICK.to_dict(), []
    bad = Job("bad", "polyengine", dict(model="random:no-such-preset", backend="reference", dtype=None, options={}), "standard")
    res = run_job(bad, workload=work, repeats=1, timeout=120, on_progress=lambda *a: seen.append(a))
    assert res["event"] == "error" and "no-such-preset" in res["error"] and res["traceback"]
    assert seen and seen[0][0] == "load"
    slow = Job("slow", "polyengine", dict(model="random:tiny", backend="reference", dtype=None, options={}), "standard")
    # a million repeats never end: the time limit stops the worker
    res = run_job(slow, workload=work, repeats=10**6, timeout=2, on_progress=lambda *a: None)
    assert res["event"] == "error" and "time limit" in res["error"]
    # a worker that fails after some phases keeps them: on the tiny model (512 positions)
    # the standard decode phases run, then the 1024-token prefill is refused
    res = run_job(slow, workload=STANDARD.to_dict(), repeats=1, timeout=120, on_progress=lambda *a: None)
    assert res["event"] == "error" and "1" in res["partial_metrics"]["decode_tok_s"]
    assert res["system"]["backend"] == "reference"  # what it was, even though it did not finish


def test_bench_exits_nonzero_when_a_polyengine_row_fails(tmp_path):
    code, stdout, stderr = _bench(["--quick", "--backend", "reference", "--parts", "standard",
                                   "--model", "random:no-such-preset"], tmp_path)
    assert code == 1
    assert re.search(r"\|\s+error\s+\|", stdout) and "failures:" in stdout and "no-such-preset" in stdout
    assert "FAIL" not in stdout, "a failed row is an error, not a verdict"
    assert "| transformers" not in stdout and "| llama.cpp" not in stdout, "--quick runs no peer unless asked"


def test_targets_are_judged_only_when_a_file_is_given(monkeypatch):
    """``--targets``: the verdict lines under the file's heading and the JSON's
    ``targets``; without it, no verdict, PASS or FAIL line (the jobs are stubbed: this
    checks the run's bookkeeping and the report, not a worker)."""
    import argparse

    from polyengine.benchmarks import cli, host, report
    from polyengine.benchmarks.jobs import Job

    monkeypatch.setattr(host, "torch_cpu", lambda env=None: None)  # its probe starts torch: not what this checks
    jobs = [Job("polyengine reference float64", "polyengine", {}, "standard", parts=["standard"])]
    monkeypatch.setattr(cli, "plan", lambda args, notes: jobs)
    monkeypatch.setattr(cli, "_run_row", lambda job, work, repeats, timeout, progress: {
        "row": job.row, "kind": "polyengine", "system": "polyengine", "setting": "reference float64",
        "params": {"options": {}}, "details": {"dtype": "float64"}, "errors": {},
        "metrics": {"decode_tok_s": {"1": {"median": 10.0}, "4": {"median": 30.0}}, "prefill_tok_s": {"median": 50.0},
                    "peak_rss_mib": 300.0}})

    def run(targets):
        args = argparse.Namespace(quick=True, repeats=None, timeout=None, parts="standard", isa=None,
                                  model="random:tiny", json=None, targets=targets)
        doc = cli.run(args)
        return doc, report.render(doc)

    doc, text = run(None)
    assert doc["targets"] == [] and doc["targets_from"] == []
    assert not any(w in text for w in ("PASS", "FAIL", "targets", "issue")), text
    path = str(TARGETS / "cpu-round2.toml")
    doc, text = run([path])
    assert doc["targets_from"] == [path] and len(doc["targets"]) == 6
    assert f"targets from {path} (CPU speed, second round)" in text
    assert ("best decode b4 >= 2x transformers [polyengine reference float64]: not judged: no transformers row has "
            "this value") in text


def test_a_malformed_targets_file_is_refused_before_any_job(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[compare]]\nname = "x"\nmetric = "decode.1"\npeer = "transformers"\nratio = 1\n')
    code, stdout, stderr = _bench(["--quick", "--backend", "reference", "--model", "random:tiny",
                                   "--targets", str(bad)], tmp_path)
    assert code == 1 and "is no metric" in stderr and "[1/" not in stderr, stderr


def test_gguf_copies_keep_metadata_and_values(tmp_path):
    import gguf

    from polyengine.benchmarks.gguf_convert import converted_gguf

    src = tmp_path / "tiny.gguf"
    rng = np.random.default_rng(0)
    embd = rng.normal(size=(8, 64)).astype(np.float32)
    norm = (1 + 0.1 * rng.normal(size=64)).astype(np.float32)
    w = gguf.GGUFWriter(src, arch="llama")
    w.add_name("tiny")
    w.add_block_count(1)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_token_list(["a", "b", "c"])
    q8 = gguf.quants.quantize(embd, gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", norm)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    out = converted_gguf(src, "F16", tmp_path / "cache")
    assert converted_gguf(src, "F16", tmp_path / "cache") == out  # cached
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(out)
    assert set(a.fields) == set(b.fields)
    assert b.get_field("general.file_type").contents() == 1
    assert b.get_field("tokenizer.ggml.tokens").contents() == ["a", "b", "c"]
    tensors = {t.name: t for t in b.tensors}
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    expect = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    got = np.asarray(tensors["token_embd.weight"].data, np.float32).reshape(expect.shape)
    np.testing.assert_allclose(got, expect, rtol=1e-3, atol=1e-3)  # F16 rounding of the Q8_0 values
    np.testing.assert_array_equal(np.asarray(tensors["blk.0.attn_norm.weight"].data), norm)


def _bench_with_transformers(tmp_path: Path, part: str, *more: str) -> tuple[dict, str]:
    """``bench --quick --parts PART`` of the reference backend beside transformers, on a
    tiny random HF model (transformers loads it from its folder)."""
    pytest.importorskip("transformers")
    from _oracle import hf_model

    folder = tmp_path / "tiny-hf"
    hf_model("llama3", vocab=131).save_pretrained(folder)
    out = tmp_path / f"{part}.json"
    code, stdout, stderr = _bench(["--quick", "--backend", "reference", "--model", str(folder), "--peers", "transformers",
                                   "--parts", part, "--json", str(out), "--cache-dir", str(tmp_path / "cache"), *more],
                          tmp_path)
    assert code == 0, stdout + stderr
    return json.loads(out.read_text()), stdout


@pytest.mark.slow
def test_quick_bench_runs_transformers_on_a_tiny_random_model(tmp_path):
    doc, _ = _bench_with_transformers(tmp_path, "standard", "--targets", str(TARGETS / "cpu-round2.toml"))
    peers = [r for r in doc["rows"] if r["kind"] == "transformers"]
    assert peers and all(not r["errors"] for r in peers), [r.get("tracebacks") for r in peers]
    fp32 = next(r for r in peers if r["details"]["dtype"] == "float32")
    assert set(fp32["metrics"]["decode_tok_s"]) == {"1", "2", "4"}
    assert fp32["metrics"]["driver_overhead_s_per_step"] is None  # generate has no driver to time
    judged = [v for v in doc["targets"] if v["target"].startswith("best prefill")]
    assert judged and all("ratio" in v for v in judged)


def test_parts_and_peers_alone(tmp_path):
    out = tmp_path / "long.json"
    code, stdout, stderr = _bench(["--quick", "--backend", "reference", "--model", "random:tiny", "--peers", "none",
                                   "--parts", "long", "--json", str(out)], tmp_path)
    assert code == 0, stdout + stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row["metrics"]) == {"long_decode_tok_s", "long_peak_rss_mib"}
    code, stdout, stderr = _bench(["--quick", "--backend", "none", "--peers", "none", "--parts", "standard",
                                   "--targets", str(TARGETS / "cpu-round2.toml")], tmp_path)
    assert code == 0 and "no polyengine row in this run applies" in stdout, stdout + stderr
    code, _, stderr = _bench(["--quick", "--parts", "middle"], tmp_path)
    assert code == 1 and "--parts" in stderr


def test_quick_prefix_part_reports_every_workload_and_its_targets(tmp_path):
    """``--parts prefix``: the shared prefix, the conversations, the long prompt under load
    and serve with the cache on and off, each number where the report documents it, the
    in-row targets judged; transformers runs the two workloads it can (its own K/V reuse)
    and says why not the third."""
    doc, stdout = _bench_with_transformers(tmp_path, "prefix", "--targets", str(TARGETS / "prefix-caching.toml"))
    ours = next(r for r in doc["rows"] if r["kind"] == "polyengine")
    m = ours["metrics"]
    for key in ("prefix_shared_ttft_p50_s", "prefix_shared_ttft_p90_s", "prefix_serve_e2e_tok_s"):
        assert set(m[key]) == {"cache", "no_cache"} and all(v > 0 for v in m[key].values()), key
    assert len(m["prefix_shared_ttft_samples_s"]["cache"]) == QUICK.shared_requests
    assert [len(m["prefix_turn_ttft_s"][k]) for k in ("cache", "no_cache")] == [QUICK.turns] * 2
    assert set(m["prefix_loaded_itl_s"]) == {"chunked", "whole"} and m["prefix_loaded_chunk"] > 0
    for itl in m["prefix_loaded_itl_s"].values():
        assert 0 < itl["median"] <= itl["p99"] <= itl["max"] and 0 < itl["before"] <= itl["max"]
    judged = {v["target"] for v in doc["targets"] if v.get("kind") == "self" and v["row"] == ours["row"]}
    assert len(judged) == 5 and "prefix caching and chunked prefill" in stdout
    peer = next(r for r in doc["rows"] if r["kind"] == "transformers" and r["details"]["dtype"] == "float32")
    assert not peer["errors"], peer.get("tracebacks")
    assert set(peer["metrics"]["prefix_shared_ttft_p50_s"]) == {"cache", "no_cache"}
    assert "prefix_loaded_itl_s" not in peer["metrics"] and any("long-prompt" in n for n in peer["notes"])


def test_quick_pages_part_reports_both_settings_and_variants(tmp_path):
    """``--parts pages``: the quick workload's requests on paged K/V (a pool of the pages of
    the reserved slots' full contexts: the same K/V positions) and on the reserved slots,
    with a shared system prompt and without; every request completes on both, the paged
    engine runs more of them at once, and the table says so."""
    out = tmp_path / "pages.json"
    code, stdout, stderr = _bench(["--quick", "--backend", "reference", "--model", "random:tiny", "--peers", "none",
                                   "--parts", "pages", "--json", str(out)], tmp_path)
    assert code == 0, stdout + stderr
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    runs = row["metrics"]["pages_runs"]
    assert set(runs) == {"shared", "distinct"} and all(set(v) == {"paged", "reserved"} for v in runs.values())
    for variant in runs.values():
        paged, reserved = variant["paged"], variant["reserved"]
        for run in (paged, reserved):
            assert run["requests"] == run["completed"] == QUICK.pages_requests and run["failed"] == 0
            assert run["completion_tokens"] == QUICK.pages_requests * QUICK.pages_new_tokens and run["seconds"] > 0
            assert 0 < run["cpu_seconds"]  # the worker's CPU time over the run (process-wide)
        assert paged["kv_positions"] == reserved["kv_positions"] == QUICK.pages_reserved_slots * QUICK.pages_context
        assert paged["pool_pages"] == QUICK.pages_pool and 0 < paged["peak_pages"] <= QUICK.pages_pool
        assert reserved["peak_running"] == QUICK.pages_reserved_slots < paged["peak_running"]
        assert reserved["pool_pages"] is None and reserved["preemptions"] == 0
    assert runs["shared"]["paged"]["cached_tokens"] > 0 and runs["distinct"]["paged"]["cached_tokens"] == 0
    assert "paged K/V against full reservations (pages part):" in stdout
    assert f"paged: {QUICK.pages_pool} pages of {QUICK.pages_page_size}" in stdout, stdout
    assert "CPU s" in stdout, stdout
    assert "pages_peak_rss_mib" in row["metrics"]


def test_emulate_avx2_restricts_every_worker_and_probe(tmp_path):
    """``--emulate avx2`` on a tiny model: the cpu row runs isa avx2 with torch
    itself restricted to AVX2 in its worker (its paths say so), and the header, torch's
    probe and the limits say which host kind was emulated."""
    from polyengine.hostinfo import runnable_isas

    if "avx2" not in runnable_isas():
        pytest.skip("this CPU does not run AVX2")
    out = tmp_path / "emu.json"
    code, stdout, stderr = _bench(["--quick", "--backend", "cpu", "--model", "random:tiny", "--peers", "none",
                                   "--parts", "standard", "--emulate", "avx2", "--json", str(out)], tmp_path)
    assert code == 0, stdout + stderr
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["isa"] == "avx2" and row["params"]["options"] == {"isa": "avx2"}
    assert "torch capability AVX2" in row["details"]["paths"]["cpu"], row["details"]["paths"]
    assert doc["host"]["torch"]["capability"] == "AVX2"
    emulated = doc["host"]["emulated"]
    assert emulated["kind"] == "avx2" and emulated["env"]["ATEN_CPU_CAPABILITY"] == "avx2"
    assert not {"avx512f", "avx512_bf16"} & set(emulated["isa"])
    assert "read_gb_s" in doc["host"]["limits"] and len(row["read_probes_gb_s"]) == 2
    assert "EMULATED: an avx2-only host" in stdout


def test_emulate_plans_peers_as_on_that_host(monkeypatch, tmp_path):
    """transformers in float32 only, llama.cpp only on a library folder given for the
    host kind (skipped, with the build commands, without one), whose features it
    checks; --isa other than the kind's is refused."""
    import argparse

    from polyengine.benchmarks import cli, host
    from polyengine.benchmarks.run_llamacpp import cpu_features
    from polyengine.errors import InvalidRequest

    avx512 = {**host.cpu_info(), "isa": ["avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16"]}
    monkeypatch.setattr(host, "cpu_info", lambda: avx512)
    monkeypatch.setattr(cli, "_model_file", lambda model: (Path(tmp_path / "m.gguf"), "m.gguf"))
    monkeypatch.setattr(cli, "_prepare_transformers", lambda path, cache, notes: True)
    monkeypatch.setattr(cli, "_llamacpp_files", lambda path, cache, notes, quants: [("Q4_1", path)])
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())  # every peer "installed"

    def plan(**kw):
        args = argparse.Namespace(backend=["none"], dtype=[None], options=None, isa=None, peers="transformers,llamacpp",
                                  model=None, cache_dir=str(tmp_path), llamacpp_threads=None, llamacpp_quants=None,
                                  emulate="avx2", llamacpp_lib=None)
        for k, v in kw.items():
            setattr(args, k, v)
        notes: list[str] = []
        return cli.plan(args, notes), notes

    jobs, notes = plan()
    assert [j.row for j in jobs] == ["transformers fp32"] and jobs[0].env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert any("float32 only" in n for n in notes)
    (skip,) = [n for n in notes if n.startswith("llama.cpp")]
    assert "--llamacpp-lib" in skip and "-DGGML_AVX2=ON" in skip and "AVX512" not in skip
    with pytest.raises(InvalidRequest, match="no libllama.so"):
        plan(llamacpp_lib=str(tmp_path))
    (tmp_path / "libllama.so").write_bytes(b"")
    jobs, _ = plan(llamacpp_lib=str(tmp_path))
    lcpp = jobs[-1]
    assert lcpp.env["LLAMA_CPP_LIB_PATH"] == str(tmp_path.resolve()) and "AVX512" in lcpp.params["forbid"]
    with pytest.raises(InvalidRequest, match="drop --isa"):
        plan(isa="avx512", backend=["none"])
    jobs, notes = plan(emulate=None)
    assert [j.row for j in jobs][:2] == ["transformers fp32", "transformers bf16"] and not jobs[0].env
    info = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VBMI = 0 | LLAMAFILE = 1 | "
    assert cpu_features(info) == {"SSE3", "AVX2", "AVX512", "LLAMAFILE"}


def test_llamacpp_refuses_a_library_with_features_the_emulated_host_lacks(default_gguf):
    pytest.importorskip("llama_cpp")
    from polyengine.benchmarks.run_llamacpp import LlamaCppSystem

    with pytest.raises(RuntimeError, match="uses SSE3, which the emulated host lacks"):
        LlamaCppSystem(model=str(default_gguf), quant="Q4_1", threads=1, forbid=["SSE3"])
