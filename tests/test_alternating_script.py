"""benchmarks/scripts/alternating.py (systems measured in alternation, one run of each in
turn) runs end to end: every system in its own worker for the whole run, a line per round
with every system's rate, the medians' table and the per-round ratios against the last
row. Two settings of the cpu backend on a tiny random model (llama.cpp, its usual last
row, is not installed in CI); the numbers of record are docs/benchmarks/2026-12-quantized.md's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scripts" / "alternating.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--model", "random:tiny", *args],
                          capture_output=True, text=True, timeout=300)


def test_alternating_rounds_medians_and_paired_ratios():
    a, b = '{"threads": 1}', '{"repack_weights": false, "threads": 1}'
    proc = _run("--options", a, "--options", b, "--no-llamacpp", "--rounds", "3", "--batches", "1,2",
                "--prompt", "16", "--new-tokens", "6", "--prefill", "40")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    rounds = re.findall(r"^round (\d)/3 .*decode b1: ([\d.]+) / ([\d.]+); decode b2: ([\d.]+) / ([\d.]+); "
                        r"prefill 40: ([\d.]+) / ([\d.]+)$", out, re.M)
    assert [r[0] for r in rounds] == ["1", "2", "3"]
    assert all(float(v) > 0 for r in rounds for v in r[1:])
    assert "| system | decode b1 tok/s | decode b2 tok/s | prefill 40 tok/s |" in out
    rows = [line for line in out.splitlines() if line.startswith("| polyengine cpu")]
    assert len(rows) == 3  # two systems, one line of ratios against the last
    ratio = re.search(r"median of the rounds' ratios \(range\) \| ([\d.]+)x \(([\d.]+)-([\d.]+)\)", rows[2])
    lo, mid, hi = float(ratio.group(2)), float(ratio.group(1)), float(ratio.group(3))
    assert lo <= mid <= hi
    # the ratio is the median of the rounds' own ratios (decode b1: columns 2 and 3 of each round)
    per_round = sorted(float(r[1]) / float(r[2]) for r in rounds)
    assert abs(per_round[1] - mid) < 0.01 and abs(per_round[0] - lo) < 0.01 and abs(per_round[2] - hi) < 0.01


def test_alternating_refuses_a_run_with_nothing_to_compare():
    proc = _run("--options", '{"threads": 1}', "--no-llamacpp", "--rounds", "1")
    assert proc.returncode != 0
    assert "nothing to compare" in proc.stderr
