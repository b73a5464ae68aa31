"""The host's own limits (memory read bandwidth, torch's float32 GEMM rate), measured in the bench run.

A ratio target can ask for more than the host allows: at batch 1 a float32 decode step
reads every weight once, so it cannot beat memory bandwidth / weight bytes tokens per
second (and a file's weights kept as stored, a GGUF file's blocks, bandwidth / the bytes
of the file's tensors a step reads: ``stored_b1_floor_tok_s``, whatever reads them); at the largest batch it multiplies every weight by every row, so it cannot
beat torch's float32 GEMM rate / (2 x parameters). A target of a targets file may cap
what it asks at 80% of such a limit (``host_limit``; docs/benchmarks.md#targets), and
every polyengine row reports its share of them. Both are measured here, in a
subprocess run before any job (never beside one):

- ``read_gb_s``: a float32 sum over a 512 MiB tensor (far larger than any cache) with
  torch's threads, median of 5: what streaming the weights can reach. A shared host's
  bandwidth drifts during a half-hour run (one probe before the jobs read 56 GB/s where
  the same probe read 36-38 before and after), so ``measure_read`` probes again right
  before and right after each polyengine row (never beside a job), and the row's floor
  (``for_row``) uses the mean of its two probes: the bandwidth of the minutes its batch-1
  decode ran in;
- ``gemm_gflop_s``: ``F.linear`` of ``(batch, hidden)`` by ``(intermediate, hidden)``
  float32, the model's widest projection at the largest decode batch, median of 7.

The model's parameter count comes from its config (``Model.config``), and the bytes a
decode step streams per weight kind (``weight_bytes``: float32, bfloat16, float16 at
4/2/2 bytes a parameter; each int8 mode's copies with their scales, which replace every
projection and the LM head) from it too.

``report.reached`` turns a row's numbers into the share of these limits it reached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

__all__ = ["measure", "measure_read", "for_row", "CAP", "BANDWIDTH_LIMITS"]

CAP = 0.8  # a target past a host limit becomes this fraction of the limit
# The limits set by memory bandwidth (they follow a row's own read probes, ``for_row``).
BANDWIDTH_LIMITS = ("fp32_b1_floor_tok_s", "stored_b1_floor_tok_s")

_READ = r"""
import json, sys, time
import torch

def median(fn, n):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]

big = torch.ones(128 * 2**20)
big.sum()
read = big.numel() * 4 / median(big.sum, 5) / 1e9
del big
"""

_SNIPPET = _READ + r"""
from polyengine.models.loader import load_model
from polyengine.models.quantize import WEIGHT_MODES, int8_bytes

spec, batch = sys.argv[1] or None, int(sys.argv[2])
model = load_model(spec)
config = model.config
params = config.num_parameters()
# The bytes a batch-1 decode step of the weights as stored streams: every record but the
# embedding table (only its looked-up rows are read), unless it is also the LM head.
records = model.records
stored = sum(w.data.nbytes for name, w in records.items()
             if name != "model.embed_tokens.weight" or "lm_head.weight" not in records)
x = torch.randn(batch, config.hidden_size)
w = torch.randn(config.intermediate_size, config.hidden_size)
torch.nn.functional.linear(x, w)
gemm = 2 * batch * config.hidden_size * config.intermediate_size / median(lambda: torch.nn.functional.linear(x, w), 7) / 1e9
print(json.dumps({
    "read_gb_s": read, "gemm_gflop_s": gemm, "gemm_shape": [batch, config.hidden_size, config.intermediate_size],
    "params": params, "threads": torch.get_num_threads(),
    "fp32_b1_floor_tok_s": read * 1e9 / (4 * params), "fp32_gemm_tok_s": gemm * 1e9 / (2 * params),
    "stored_b1_floor_tok_s": read * 1e9 / stored,
    "weight_bytes": {"float32": 4 * params, "bfloat16": 2 * params, "float16": 2 * params, "stored": stored,
                     **{mode: int8_bytes(config, mode) for mode in WEIGHT_MODES}},
}))
"""


def _env(env: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, **(env or {})}


def measure_read(env: dict[str, str] | None = None) -> float | None:
    """``read_gb_s`` alone, in a fresh subprocess (a few seconds; ``env``: an emulation's,
    set in it); None where it fails. Call it only between jobs, never beside one."""
    try:
        out = subprocess.run([sys.executable, "-c", _READ + "\nprint(json.dumps(read))"], capture_output=True,
                             text=True, timeout=120, check=True, env=_env(env)).stdout
        return float(json.loads(out.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None


# How far the host's read rate may move across a run's probes before the report says so.
DRIFT_RATIO = 1.2


def drift(limits: dict[str, Any] | None, rows: list[dict[str, Any]]) -> str | None:
    """A note where the memory reads probed during the run (before the jobs, and before and
    after each row) moved by :data:`DRIFT_RATIO` or more, else None: the rows then ran on
    a host of another speed, and a ratio between two of them carries that."""
    reads = [(limits or {}).get("read_gb_s")] + [p for r in rows for key in ("read_probes_gb_s", "peer_read_probes_gb_s")
                                                 for p in r.get(key) or ()]
    reads = [p for p in reads if p]
    if len(reads) < 2 or max(reads) < DRIFT_RATIO * min(reads):
        return None
    return (f"the host's memory read rate moved between {min(reads):.1f} and {max(reads):.1f} GB/s during this run "
            f"(probed before and after each row): a ratio between rows measured minutes apart carries that; "
            f"benchmarks/scripts/alternating.py measures systems in alternation, each ratio from runs seconds apart")


def for_row(limits: dict[str, Any] | None, row: dict[str, Any]) -> dict[str, Any] | None:
    """``limits`` as they held for ``row``: where the row has read probes of its own
    (``read_probes_gb_s``, taken right before and after it), ``read_gb_s`` is their mean
    and the float32 batch-1 floor scales with it; otherwise ``limits`` unchanged."""
    probes = [p for p in row.get("read_probes_gb_s") or () if p]
    if not probes or not limits or "error" in limits or not limits.get("read_gb_s"):
        return limits
    read = sum(probes) / len(probes)
    out = {**limits, "read_gb_s": read}
    for name in BANDWIDTH_LIMITS:
        if name in limits:
            out[name] = limits[name] * read / limits["read_gb_s"]
    return out


def measure(model: str | None, batch: int, env: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The limits above, or ``{"error": ...}`` where the probe fails; None without torch.
    ``env``: an emulation's (``host.EMULATIONS``), set in the probe's process, so the GEMM
    rate is the emulated host's."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return None
    try:
        out = subprocess.run([sys.executable, "-c", _SNIPPET, model or "", str(batch)], capture_output=True,
                             text=True, timeout=300, check=True, env=_env(env)).stdout
        return json.loads(out.strip().splitlines()[-1])
    except subprocess.CalledProcessError as exc:
        return {"error": f"the limits probe failed: {exc.stderr.strip()[-300:]}"}
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {"error": f"the limits probe failed: {type(exc).__name__}: {exc}"}

