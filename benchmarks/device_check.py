"""``polyengine device-check``: one command that proves a backend's device path on its device.

    polyengine device-check --backend cuda_torch|tpu_jax|neuron [--dry-run] [--output PATH] [--json PATH]

Where the backend's accelerator is present (a GPU, a TPU, Neuron devices) it runs, in
order, and writes one Markdown report meant to be pasted into the backend's doc:

1. **device**: what the probe sees, the device's name and the package versions;
2. **conformance**: the whole conformance suite on the device (``polyengine conformance``
   in a subprocess, as a user runs it);
3. **CUDA graphs vs eager** (cuda_torch): decode through CUDA graphs equals eager decode
   token for token (float32 and bfloat16);
4. **greedy vs reference**: the default model (SmolLM2-135M-Instruct) on the device in
   float32 gives the reference backend's greedy tokens (and, for information, how long
   its bfloat16 output agrees);
5. **decode bench**: decode tokens/s at batch 1 and 32 on ``random:llama-1b`` (the
   Llama-3.2-1B shape, random weights) in the device's default dtype, beside the
   memory-bandwidth floor: the step time if every weight and the KV cache were read
   once at the device's HBM bandwidth (a table keyed by device name) and at the copy
   bandwidth measured in the same run. The GPU target (batch 1 at >= 50% of the HBM
   floor in bfloat16) is judged in the report.

``--dry-run`` runs the same steps on the CPU with tiny shapes, so CI knows the command
starts and every step's code runs: the suite's surface layer instead of the whole suite,
the conformance model instead of SmolLM2, and that model at batch 1 and 4 in the suite's
engine shape (whose compiled graphs the backend's tests share) instead of the 1B shape.
Steps that need the device (CUDA graphs) say so and are skipped. Without ``--dry-run``
and without the accelerator, the command refuses (exit 2) rather than report CPU
numbers as device numbers.

Exit status: 0 when no step failed (skips are listed), 1 when one did, 2 when it
cannot run here. The report goes to stdout (and ``--output``); ``--json`` writes the
same facts for machines.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["add_command", "main", "HBM_GB_S", "hbm_bandwidth", "BACKENDS"]

BACKENDS = ("cuda_torch", "tpu_jax", "neuron")
# Peak memory bandwidth, GB/s, from the vendors' spec sheets, by a substring of the
# device name (first match wins, so specific names come first). Neuron figures are per
# chip; a NeuronCore gets its share (2 cores per Trainium1/Inferentia2 chip, 8 per Trainium2).
HBM_GB_S: tuple[tuple[str, float], ...] = (
    ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
    ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0),
    ("L40S", 864.0), ("L4", 300.0), ("A10G", 600.0), ("A10", 600.0), ("V100", 900.0), ("T4", 320.0),
    ("TPU v6", 1640.0), ("TPU v5p", 2765.0), ("TPU v5 lite", 819.0), ("TPU v5e", 819.0), ("TPU v4", 1200.0),
    ("trn2", 2900.0 / 8), ("trn1", 820.0 / 2), ("inf2", 820.0 / 2),
)
_LIMITS = dict(max_slots=4, max_prefill_length=24, max_cache_length=64)  # the conformance suite's engine shape
_CHAT = "What is the capital of France? Answer in one sentence."


def hbm_bandwidth(device_name: str) -> float | None:
    """The table's GB/s for ``device_name`` (None: not in the table)."""
    return next((gb for key, gb in HBM_GB_S if key.lower() in device_name.lower()), None)


@dataclass
class Step:
    name: str
    status: str = "pass"  # pass, fail, skip
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)  # Markdown
    facts: dict[str, Any] = field(default_factory=dict)


def add_command(sub: Any) -> None:
    p = sub.add_parser(
        "device-check", help="prove a backend's device path on its device, in one Markdown report",
        description="Run the conformance suite, CUDA graphs vs eager (GPU), greedy output vs the reference and a "
                    "decode bench beside the memory-bandwidth floor on the backend's accelerator; --dry-run runs "
                    "the same steps on the CPU with tiny shapes. See docs/benchmarks.md.")
    add_arguments(p)
    p.set_defaults(func=lambda args: main(args))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", required=True, choices=BACKENDS)
    p.add_argument("--dry-run", action="store_true", help="the same steps on the CPU with tiny shapes (what CI runs)")
    p.add_argument("--output", metavar="PATH", default=None, help="also write the Markdown report here")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the report's facts as JSON here")
    p.add_argument("--steps", default="device,conformance,cuda_graphs,greedy,bench",
                   help="comma-separated steps to run (default: all)")


# -- the device -------------------------------------------------------------------------


def _accelerator(backend: str) -> tuple[bool, str]:
    from polyengine.plugins import list_backends

    info = {b.name: b for b in list_backends()}[backend]
    probe = info.to_dict()
    return bool(probe.get("accelerator")), str(probe.get("reason", ""))


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for dist in ("polyengine", "torch", "jax", "jaxlib", "libtpu", "torch-neuronx", "neuronx-cc", "neuronx-distributed"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def _device_name(backend: str, dry_run: bool) -> str:
    if dry_run:
        from polyengine.hostinfo import cpu_model

        return f"CPU: {cpu_model()}"
    if backend == "cuda_torch":
        import torch

        return torch.cuda.get_device_name(0)
    if backend == "tpu_jax":
        import jax

        d = jax.devices()[0]
        return f"{d.device_kind} ({len(jax.devices())} chips)"
    try:  # EC2 names its instance type here (trn1.32xlarge, inf2.xlarge, ...)
        return Path("/sys/devices/virtual/dmi/id/product_name").read_text().strip()
    except OSError:
        return "Neuron (instance type unknown)"


def step_device(ctx: "Check") -> Step:
    s = Step("device")
    present, reason = _accelerator(ctx.backend)
    ctx.device_name = _device_name(ctx.backend, ctx.dry_run)
    s.facts = {"accelerator_present": present, "probe": reason, "device": ctx.device_name, "versions": _versions()}
    s.lines = [f"- backend `{ctx.backend}`; probe: {reason}", f"- device: **{ctx.device_name}**",
               "- versions: " + ", ".join(f"{k} {v}" for k, v in s.facts["versions"].items())]
    return s


# -- the conformance suite ------------------------------------------------------------------


def step_conformance(ctx: "Check") -> Step:
    s = Step("conformance")
    report = Path(ctx.tmp) / "conformance.json"
    cmd = [sys.executable, "-m", "polyengine.cli", "conformance", "--backend", ctx.backend, "--report-json", str(report)]
    env = dict(os.environ)
    if ctx.dry_run:
        cmd += ["-k", "layer_surface"]
        if ctx.backend == "cuda_torch":
            cmd += ["--option", "device=cpu"]  # the device path's CPU stand-in: without a GPU it refuses
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if not report.exists():
        s.status = "fail"
        s.lines = [f"- the suite did not report (exit {proc.returncode}):", "", "```", proc.stdout[-2000:] + proc.stderr[-2000:], "```"]
        return s
    doc = json.loads(report.read_text())
    summary = doc["summary"]
    s.facts = {"exit": proc.returncode, "summary": summary, "device": doc.get("device", {})}
    s.status = "pass" if proc.returncode == 0 and all(v.get("failed", 0) == 0 for v in summary.values()) else "fail"
    what = "the surface layer (dry run)" if ctx.dry_run else "the whole suite"
    s.lines = [f"- {what}, `polyengine conformance --backend {ctx.backend}` on {doc.get('device', {}).get('backend', '?')}",
               "", "| layer | passed | failed | skipped | xfailed |", "| --- | ---: | ---: | ---: | ---: |"]
    for layer, v in summary.items():
        s.lines.append(f"| {layer} | {v.get('passed', 0)} | {v.get('failed', 0)} | {v.get('skipped', 0)} | {v.get('xfailed', 0)} |")
    return s


# -- engines ------------------------------------------------------------------------------


def _engine(ctx: "Check", model, **config):
    from polyengine import EngineConfig
    from polyengine.plugins import create_engine

    options = dict(config.pop("options", {}))
    if ctx.backend == "neuron" and ctx.dry_run:
        options.setdefault("compiler", "inductor")
    if ctx.backend == "cuda_torch" and ctx.dry_run:
        options.setdefault("device", "cpu")  # the device path's CPU stand-in: without a GPU it refuses
    return create_engine(backend=ctx.backend, model=model, config=EngineConfig(**config, options=options))


def _greedy(engine, prompts, max_tokens: int) -> list[list[int]]:
    from polyengine import SamplingParams
    from polyengine.driver import LLM

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [c.token_ids for c in LLM.from_engine(engine, tools=False).generate(prompts, sp)]


def _agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def step_cuda_graphs(ctx: "Check") -> Step:
    s = Step("cuda_graphs")
    if ctx.backend != "cuda_torch":
        s.status, s.lines = "skip", [f"- not applicable: `{ctx.backend}` has no CUDA graphs"]
        return s
    if ctx.dry_run:
        s.status, s.lines = "skip", ["- needs a GPU (the CPU refuses `cuda_graphs`): not run in a dry run"]
        return s
    from polyengine.models import load_model

    model = load_model("random:tiny-gqa")
    prompts = [[1, 5, 9, 4, 2], [3, 3, 8], [7] * 20]
    s.lines = ["| dtype | tokens compared | equal |", "| --- | ---: | --- |"]
    for dtype in ("float32", "bfloat16"):
        runs = [_greedy(_engine(ctx, model, max_slots=4, max_prefill_length=24, max_cache_length=128, dtype=dtype,
                                options={"cuda_graphs": graphs}), prompts, 80) for graphs in (False, True)]
        equal = runs[0] == runs[1]
        s.facts[dtype] = equal
        s.lines.append(f"| {dtype} | {sum(map(len, runs[0]))} | {'yes' if equal else '**no**'} |")
        if not equal:
            s.status = "fail"
    return s


def step_greedy(ctx: "Check") -> Step:
    from polyengine import EngineConfig
    from polyengine.backends.reference.engine import ReferenceEngine

    s = Step("greedy")
    if ctx.dry_run:
        from polyengine.conformance.models import build_model

        model, prompts, tokens, label = build_model("mha_tied"), [[1, 5, 9, 4, 2], [3, 9, 4, 7]], 16, "the conformance model mha_tied (dry run)"
        shape = dict(_LIMITS)
    else:
        from polyengine.models import load_model

        model = load_model(None)
        tok = model.tokenizer
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": _CHAT}])),
                   tok.encode("The capital of France is")]
        tokens, label, shape = 32, "the default model (SmolLM2-135M-Instruct)", dict(max_slots=4, max_prefill_length=64,
                                                                                    max_cache_length=128)
    want = _greedy(ReferenceEngine(model, EngineConfig(**shape)), prompts, tokens)
    got = _greedy(_engine(ctx, model, dtype="float32", **shape), prompts, tokens)
    equal = got == want
    s.status = "pass" if equal else "fail"
    s.lines = [f"- {label}, {len(prompts)} prompts x {tokens} greedy tokens, float32 on the device vs the reference "
               f"(NumPy float64): **{'equal' if equal else 'different'}**"]
    s.facts = {"equal": equal, "agreement": [_agreement(a, b) for a, b in zip(got, want)]}
    if not ctx.dry_run:
        try:
            bf16 = _greedy(_engine(ctx, model, dtype="bfloat16", **shape), prompts, tokens)
            s.facts["bfloat16_agreement"] = [_agreement(a, b) for a, b in zip(bf16, want)]
            s.lines.append(f"- bfloat16 (information): tokens equal to the reference's before the first difference: "
                           f"{s.facts['bfloat16_agreement']} of {tokens}")
        except Exception as exc:  # a backend without bfloat16 here
            s.lines.append(f"- bfloat16: not run ({type(exc).__name__}: {exc})")
    return s


# -- the bench ----------------------------------------------------------------------------


def _copy_bandwidth(ctx: "Check") -> float | None:
    """GB/s of a large copy on the device (bytes read + written over the time)."""
    n, reps = (64 * 2**20, 5) if ctx.dry_run else (2**30, 10)
    if ctx.dry_run:
        import numpy as np

        src, dst = np.ones(n, np.uint8), np.empty(n, np.uint8)
        np.copyto(dst, src)
        start = time.perf_counter()
        for _ in range(reps):
            np.copyto(dst, src)
        return 2 * n * reps / (time.perf_counter() - start) / 1e9
    if ctx.backend == "cuda_torch":
        import torch

        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        y.copy_(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            y.copy_(x)
        end.record()
        end.synchronize()
        return 2 * n * reps / (start.elapsed_time(end) / 1e3) / 1e9
    if ctx.backend == "tpu_jax":
        import jax
        import jax.numpy as jnp

        x = jnp.ones(n // 4, jnp.float32)
        bump = jax.jit(lambda a: a + 1.0)
        bump(x).block_until_ready()
        start = time.perf_counter()
        for _ in range(reps):
            y = bump(x)
        y.block_until_ready()
        return 2 * n * reps / (time.perf_counter() - start) / 1e9
    return None  # Neuron: no device copy that runs outside a compiled graph


def _decode_rate(engine, batch: int, prompt_len: int, steps: int, warm: int = 3) -> tuple[float, float]:
    """Greedy decode tokens/s and seconds per step for ``batch`` requests, results read
    one step behind (as the driver does)."""
    from polyengine import SamplingParams

    params, state = engine.load_params(), engine.init_decode_state()
    sp = SamplingParams(temperature=0, ignore_eos=True)
    for slot in range(batch):
        prompt = [(7 * slot + 3 * i) % 200 + 1 for i in range(prompt_len)]
        prefix, _ = engine.prefill(params=params, tokens=prompt, sampling=sp)
        state = engine.insert(prefix, state, slot)
    for _ in range(warm):
        state, res = engine.generate(params, state)
        res.tokens
    results = []
    start = time.perf_counter()
    for _ in range(steps):
        state, res = engine.generate(params, state)
        if results:
            results[-1].valid  # read the previous step while this one runs
        results.append(res)
    tokens = sum(int(r.valid.sum()) for r in results)
    elapsed = time.perf_counter() - start
    return tokens / elapsed, elapsed / steps


def step_bench(ctx: "Check") -> Step:
    from polyengine.models import load_model

    s = Step("bench")
    if ctx.dry_run:
        from polyengine.conformance.models import build_model

        model, label, batches, prompt_len, steps = build_model("mha_tied"), "mha_tied (dry run)", (1, 4), 8, 8
        shapes = {b: dict(_LIMITS) for b in batches}
    else:
        model, label, batches, prompt_len, steps = load_model("random:llama-1b"), "random:llama-1b", (1, 32), 64, 64
        shapes = {b: dict(max_slots=b, max_prefill_length=prompt_len, max_cache_length=prompt_len + steps + 16)
                  for b in batches}
    c = model.config
    measured = _copy_bandwidth(ctx)
    table = None if ctx.dry_run else hbm_bandwidth(ctx.device_name)
    s.facts = {"model": label, "parameters": c.num_parameters(), "copy_gb_s": measured, "hbm_gb_s": table, "rows": []}
    n = c.num_parameters()
    size = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"
    s.lines = [f"- model {label}: {size} parameters, random weights; prompts of {prompt_len} "
               f"tokens, {steps} measured steps after 3 warm-up steps, results read one step behind",
               f"- memory bandwidth: table {('%.0f GB/s' % table) if table else 'n/a (device not in the table)'}; "
               f"measured copy {('%.0f GB/s' % measured) if measured else 'not measured'}",
               "- floor: the step time if the weights and the batch's KV cache were read once at that bandwidth",
               "", "| dtype | decode | batch | decode tok/s | ms/step | bytes/step | floor tok/s (table) | % of floor | "
               "floor tok/s (copy) | % of floor |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    # On a GPU, cuda_torch's decode both eager (the default) and replayed from CUDA graphs
    # (option cuda_graphs): the first H200 run found eager decode bound by the host's
    # kernel launches (docs/benchmarks/2026-12-device-h200.md).
    paths = (False, True) if ctx.backend == "cuda_torch" and not ctx.dry_run else (False,)
    for batch in batches:
        for graphs in paths:
            # Graphs: one kv_len bucket over the whole cache, so its one capture falls in the
            # warm-up, not in the measured steps (attention reads fewer than 64 positions more).
            options = {"cuda_graphs": True, "kv_block": shapes[batch]["max_cache_length"]} if graphs else {}
            engine = _engine(ctx, model, options=options, **shapes[batch])
            rate, step = _decode_rate(engine, batch, prompt_len, steps)
            item = {"float32": 4, "bfloat16": 2, "float16": 2}[engine.dtype]
            per_step = c.num_parameters() * item + batch * (prompt_len + steps // 2) * c.kv_bytes_per_token(item)
            row = {"dtype": engine.dtype, "cuda_graphs": graphs, "batch": batch, "tok_s": rate,
                   "ms_per_step": step * 1e3, "bytes_per_step": per_step}
            cells = []
            for bw in (table, measured):
                floor = batch * bw * 1e9 / per_step if bw else None
                cells += [f"{floor:.1f}" if floor else "-", f"{100 * rate / floor:.0f}%" if floor else "-"]
                row[f"floor_tok_s_{'table' if bw is table else 'copy'}"] = floor
            s.facts["rows"].append(row)
            s.lines.append(f"| {engine.dtype} | {'CUDA graphs' if graphs else 'eager'} | {batch} | {rate:.1f} | "
                           f"{step * 1e3:.2f} | {per_step / 1e6:.1f} MB | " + " | ".join(cells) + " |")
            del engine
    if ctx.backend == "cuda_torch" and not ctx.dry_run:
        for b1 in (r for r in s.facts["rows"] if r["batch"] == 1):
            floor = b1["floor_tok_s_table"]
            if floor and b1["dtype"] == "bfloat16":
                share, path = b1["tok_s"] / floor, "cuda_graphs" if b1["cuda_graphs"] else "eager"
                s.facts.setdefault("target_b1_half_of_floor", {})[path] = share >= 0.5
                s.lines.append(f"- target (GPU): bfloat16 batch 1 at >= 50% of the HBM floor, {path}: {100 * share:.0f}% "
                               f"({'met' if share >= 0.5 else '**not met**'})")
    return s


# -- the report ---------------------------------------------------------------------------

_STEPS: dict[str, Callable[["Check"], Step]] = {
    "device": step_device, "conformance": step_conformance, "cuda_graphs": step_cuda_graphs, "greedy": step_greedy,
    "bench": step_bench,
}
_TITLES = {"device": "Device", "conformance": "Conformance suite on the device", "cuda_graphs": "CUDA graphs vs eager",
           "greedy": "Greedy output vs the reference", "bench": "Decode bench and the memory-bandwidth floor"}


@dataclass
class Check:
    backend: str
    dry_run: bool
    tmp: str
    device_name: str = "?"


def run(backend: str, *, dry_run: bool, steps: list[str]) -> list[Step]:
    done = []
    with tempfile.TemporaryDirectory(prefix="polyengine-device-check-") as tmp:
        ctx = Check(backend, dry_run, tmp)
        for name in steps:
            start = time.perf_counter()
            try:
                step = _STEPS[name](ctx)
            except Exception as exc:
                step = Step(name, "fail", lines=[f"- error: `{type(exc).__name__}: {exc}`", "", "```",
                                                 traceback.format_exc()[-3000:], "```"])
            step.seconds = time.perf_counter() - start
            done.append(step)
            print(f"device-check: {name}: {step.status} ({step.seconds:.1f} s)", file=sys.stderr, flush=True)
    return done


def report(backend: str, dry_run: bool, steps: list[Step]) -> str:
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    total = sum(s.seconds for s in steps)
    head = "dry run on the CPU (tiny shapes; not device results)" if dry_run else "on the device"
    out = [f"## Device check: `{backend}`, {head}", "",
           f"`polyengine device-check --backend {backend}{' --dry-run' if dry_run else ''}`, {when}, "
           f"{total:.0f} s in all.", "", "| step | result | seconds |", "| --- | --- | ---: |"]
    out += [f"| {_TITLES[s.name]} | {s.status} | {s.seconds:.1f} |" for s in steps]
    for s in steps:
        out += ["", f"### {_TITLES[s.name]}: {s.status}", "", *s.lines]
    return "\n".join(out) + "\n"


def main(args: argparse.Namespace) -> int:
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(steps) - set(_STEPS))
    if unknown or not steps:
        problem = f"unknown step(s) {unknown}" if unknown else f"--steps {args.steps!r} names no step"
        print(f"polyengine device-check: {problem}; steps: {', '.join(_STEPS)}", file=sys.stderr)
        return 2
    for flag, path in (("--output", args.output), ("--json", args.json)):
        problem = _unwritable(path)
        if problem:  # found now, not after an hour of steps
            print(f"polyengine device-check: {flag} {path}: {problem}", file=sys.stderr)
            return 2
    if args.dry_run:  # tiny models compile faster unoptimized (read when JAX is imported, which is later)
        os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    else:
        present, reason = _accelerator(args.backend)
        if not present:
            print(f"polyengine device-check: {args.backend} has no accelerator here ({reason}); run it where the device "
                  f"is, or add --dry-run to check the command on the CPU", file=sys.stderr)
            return 2
    steps_done = run(args.backend, dry_run=args.dry_run, steps=steps)
    text = report(args.backend, args.dry_run, steps_done)
    sys.stdout.write(text)
    facts = {"backend": args.backend, "dry_run": args.dry_run,
             "steps": [{"name": s.name, "status": s.status, "seconds": s.seconds, "facts": s.facts} for s in steps_done]}
    for flag, path, content in (("--output", args.output, lambda: text),
                                ("--json", args.json, lambda: json.dumps(facts, indent=1, default=str))):
        if path:
            try:
                Path(path).write_text(content(), encoding="utf-8")
            except OSError as exc:  # it went away while the steps ran: the report is on stdout
                print(f"polyengine device-check: could not write {flag} {path}: {exc.strerror or exc}", file=sys.stderr)
                return 1
    return 1 if any(s.status == "fail" for s in steps_done) else 0


def _unwritable(path: str | None) -> str | None:
    """Why the report could not be written at ``path`` (None: it could, or no path)."""
    if not path:
        return None if path is None else "an empty path"
    target = Path(path)
    if target.is_dir():
        return "is a directory"
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        return f"the folder {folder} does not exist"
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return "not writable by this user"
    return None
