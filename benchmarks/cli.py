"""``polyengine bench``: the standard workload on polyengine backends and on the peers.

    polyengine bench [--backend B ...] [--model M] [--dtype D ...] [--options JSON ...]
                     [--peers transformers,llamacpp|none] [--repeats N] [--quick] [--targets FILE ...]
                     [--json PATH] [--parts standard,long,prefix,pages|decode,prefill,serve]
                     [--workload standard|scale]
                     [--llamacpp-threads 1,2] [--llamacpp-quants LIST]
                     [--cache-dir DIR] [--isa auto,avx512,avx2,scalar|all] [--emulate avx2] [--llamacpp-lib DIR]

Plans one job per (system, part), runs each in its own worker subprocess (``jobs``),
shows progress on stderr, and prints the report (``report``) on stdout. Rows: every
combination of ``--backend``, ``--dtype``, ``--options`` and, for the backends with an
``isa`` option, ``--isa`` (each forced ISA path of the CPU kernels its own row; every
row reports the ISA path it ran and the share of the host's limits it reached);
transformers in float32 (and bfloat16 where the CPU has bf16 units); llama.cpp on the
GGUF as shipped and its F16/F32 copies (``gguf_convert``), each with its best thread
counts. Peers run by default, except with ``--quick`` (a smoke run of polyengine alone,
under a minute on the default model; ``--peers`` adds them). ``--emulate avx2`` runs
every system as on an AVX2-only host (``host.EMULATIONS``): the backend's ``isa`` option
reaches polyengine's own kernels only, this also restricts torch's code and the peers.
A peer that is not installed, or cannot read the model, is skipped with a note that says
so. The full-context batch (``long``) runs for every polyengine row and for one setting
per peer (transformers float32, llama.cpp's file as shipped): it is the slowest part,
and its point is polyengine's memory at full context, with a peer beside it for scale.
The ``prefix`` part (prefix caching and chunked prefill, ``prefix_phases``) runs when
asked for, for every polyengine row and transformers float32 (whose runner reuses a
system prompt's or a conversation's K/V itself). The ``pages`` part (issue 40's memory
target, ``pages_phases``: paged K/V against full reservations of the same engine) runs
when asked for, for polyengine rows alone; its own report table follows the main one.

Targets are judged only when ``--targets FILE`` names them (``verdicts``: TOML or JSON;
the project's own in ``benchmarks/targets/``); the report then has a PASS/FAIL line per
verdict, and never otherwise.

Exit status: 0 when every polyengine row ran (peers may fail: their failures are in
the report), 1 otherwise, 130 when interrupted (the systems that finished are reported).
Verdicts never change the exit status: this is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from polyengine.cli_run import positive_number

__all__ = ["add_command", "add_arguments", "run", "plan", "PEERS"]

PEERS = ("transformers", "llamacpp")
_INSTALL = {"transformers": "pip install torch==2.13.0 transformers accelerate"}


def add_command(sub: Any) -> None:
    p = sub.add_parser(
        "bench", help="run the standard throughput workload on backends and peers, print a table",
        description="Measure decode, prefill, continuous-batching and memory on polyengine backends and, when "
                    "installed, on transformers and llama.cpp, in one run on this host. See docs/benchmarks.md.",
    )
    add_arguments(p)
    p.set_defaults(func=_cmd_bench)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", nargs="+", default=["auto"], metavar="B", help="polyengine backend(s) to measure (default: auto), or 'none' for the peers alone")
    p.add_argument("--model", default=None, help="a .gguf file, an HF folder, a Hugging Face name (ORG/NAME[:QUANT]) or random:<preset> "
                        "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", nargs="+", default=[None], metavar="D", help="engine dtype(s) (default: the backend's)")
    p.add_argument("--options", action="append", default=None, metavar="JSON",
                   help='engine options as a JSON object, e.g. \'{"weights": "int8"}\'; repeat for several rows')
    p.add_argument("--peers", default=None,
                   help="comma-separated peers to run when installed (transformers, llamacpp), or 'none' "
                        "(default: both; with --quick: none)")
    p.add_argument("--repeats", type=int, default=None, help="measured runs per phase; the median is reported (default 3, 1 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny workload, polyengine alone unless --peers names peers: under a minute on the default "
                        "model (a smoke check; its numbers are not the standard workload's)")
    p.add_argument("--targets", action="append", default=None, metavar="FILE",
                   help="judge the run against the targets in FILE (.toml or .json; repeatable) and print a PASS/FAIL "
                        "line per verdict; the project's own: benchmarks/targets/*.toml (docs/benchmarks.md#targets)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON here")
    p.add_argument("--parts", default="standard,long", metavar="standard,long,prefix,pages,served",
                   help="which parts to run: 'standard' (decode, prefill, serve), or some of its phases ('decode', "
                        "'prefill', 'serve'), 'long' (the full-context batch), "
                        "'prefix' (prefix caching and chunked prefill: shared prefix, multi-turn, long prompt under "
                        "load), 'pages' (paged K/V: 64 requests in the pages of 8 full reservations, against those "
                        "reservations), 'served' (HTTP servers under 1, 8 and 32 concurrent clients: polyengine "
                        "serve per polyengine row against llama.cpp's llama-server on the same GGUF), comma-separated "
                        "(default: standard,long); the long batch's prefill is slow on slow systems")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="the served part's peer: a llama-server executable (default: $POLYENGINE_LLAMA_SERVER, else "
                        "llama-server on the PATH; docs/benchmarks.md says how to build it)")
    p.add_argument("--served-clients", default="1,8,32", metavar="N,N,...",
                   help="the served part's levels of concurrent clients (default 1,8,32); the servers get as many "
                        "slots as the largest level")
    p.add_argument("--served-requests", type=int, default=2, metavar="N",
                   help="streamed requests each client sends one after another, per level (default 2)")
    p.add_argument("--served-tokens", type=int, default=128, metavar="N",
                   help="new tokens of every served request, EOS ignored (default 128)")
    p.add_argument("--served-temperature", type=float, default=0.0, metavar="T",
                   help="the served requests' temperature: 0 is greedy (the default); above 0, plain sampling, "
                        "seeded, with top_p 1, top_k 0 and min_p 0 sent to both servers")
    p.add_argument("--workload", default=None, choices=("standard", "scale"),
                   help="the sizes: 'standard' (the default), or 'scale' for billion-parameter models on a CPU: "
                        "batch 1 and 8 of 32 tokens after a 128-token prompt, a 512-token prefill (--quick is the "
                        "tiny one)")
    p.add_argument("--llamacpp-threads", default=None, metavar="N,N", help="thread counts llama.cpp chooses from (default: 1 and 2)")
    p.add_argument("--llamacpp-quants", default=None, metavar="LIST",
                   help="llama.cpp settings to run: 'shipped' (the GGUF as it is), F16, F32 (default: all three)")
    p.add_argument("--cache-dir", default=None, help="where converted peer weights are kept (default: ~/.cache/polyengine/bench)")
    p.add_argument("--isa", default=None, metavar="LIST",
                   help="backends with an isa option (cpu): run each ISA path of the CPU kernels as its own row, "
                        "comma-separated from "
                        "auto, avx512, avx2, scalar; 'all' is every forced path this CPU executes (also with "
                        "--quick, the host's limits are measured then)")
    p.add_argument("--emulate", default=None, choices=("avx2",),
                   help="run every system as on an AVX2-only host: the cpu backend on isa avx2, torch restricted to AVX2 in "
                        "every worker and probe, transformers in float32 only, llama.cpp on the libraries of "
                        "--llamacpp-lib (built for AVX2; one built for AVX-512 is refused)")
    p.add_argument("--llamacpp-lib", default=None, metavar="DIR",
                   help="a folder with llama.cpp's libraries (libllama.so and its ggml libraries) for llama-cpp-python "
                        "to load instead of its own, e.g. a build for the --emulate host kind")
    p.add_argument("--timeout", type=positive_number, default=None,
                   help="seconds one worker may run (default 7200, 600 with --quick)")


def _cache_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg).expanduser()
    from polyengine.cache import cache_root  # absolute, also without a home

    return cache_root() / "bench"


def _options(raw: list[str] | None) -> list[dict[str, Any]]:
    from polyengine.errors import InvalidRequest

    out = []
    for text in raw or ["{}"]:
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise InvalidRequest(f"--options {text!r} is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise InvalidRequest(f"--options must be a JSON object, got {text!r}")
        out.append(value)
    return out


def _peers(raw: str) -> list[str]:
    from polyengine.errors import InvalidRequest

    if raw.strip().lower() == "none":
        return []
    names = [n.strip().lower().replace("llama.cpp", "llamacpp").replace("llama_cpp", "llamacpp") for n in raw.split(",") if n.strip()]
    unknown = sorted(set(names) - set(PEERS))
    if unknown:
        raise InvalidRequest(f"unknown peer(s) {unknown}; choose from {', '.join(PEERS)} or 'none'")
    return names


def _peers_arg(args: argparse.Namespace) -> str:
    """``--peers`` as given, else both peers, or none with ``--quick`` (its minute is polyengine's)."""
    given = getattr(args, "peers", None)
    if given is not None:
        return given
    return "none" if getattr(args, "quick", False) else ",".join(PEERS)


def _parts(raw: str) -> tuple[list[str], tuple[str, ...]]:
    """``--parts``: the parts to run, in order, and the standard part's phases (all of
    them for 'standard'; naming phases runs the standard part with those alone)."""
    from polyengine.benchmarks.phases import PHASES
    from polyengine.errors import InvalidRequest

    parts = [p.strip() for p in raw.split(",") if p.strip()]
    if not parts or set(parts) - set(_PARTS) - set(PHASES):
        raise InvalidRequest(f"--parts takes {', '.join(_PARTS)} or some of the standard part's phases "
                             f"({', '.join(PHASES)}), comma-separated, not {raw!r}")
    phases = PHASES if "standard" in parts else tuple(p for p in PHASES if p in parts)
    if phases:
        parts.append("standard")
    return [p for p in _PARTS if p in parts], phases


def _workload(args: argparse.Namespace) -> Any:
    """``--workload`` (or ``--quick``'s tiny one): the sizes every system runs."""
    from polyengine.benchmarks.workload import QUICK, WORKLOADS
    from polyengine.errors import InvalidRequest

    name = getattr(args, "workload", None)
    if args.quick:
        if name not in (None, "quick"):
            raise InvalidRequest(f"--quick runs the tiny workload; drop --workload {name} (or --quick)")
        return QUICK
    return WORKLOADS[name or "standard"]


_PARTS = ("standard", "long", "prefix", "pages", "served")
_ISA_BACKENDS = ("cpu",)  # backends with an engine option isa


def _isas(raw: str | None) -> list[str | None]:
    """``--isa``'s paths in order, each checked against this CPU before any job; [None]
    without it (the engine's default)."""
    from polyengine.errors import InvalidRequest
    from polyengine.hostinfo import ISA_PATHS, missing_for, runnable_isas

    if raw is None:
        return [None]
    out: list[str] = []
    for name in (n.strip().lower() for n in raw.split(",") if n.strip()):
        for isa in runnable_isas() if name == "all" else [name]:
            if isa not in ("auto", *ISA_PATHS):
                raise InvalidRequest(f"--isa {raw!r}: {isa!r} is no ISA path; use auto, {', '.join(ISA_PATHS)} or all")
            if isa != "auto" and missing_for(isa):
                raise InvalidRequest(f"--isa {isa}: this CPU cannot execute it (it lacks {', '.join(missing_for(isa))}); "
                                     f"it runs {', '.join(runnable_isas())}, or use --isa all")
            if isa not in out:
                out.append(isa)
    if not out:
        raise InvalidRequest(f"--isa {raw!r} names no ISA path; use auto, {', '.join(ISA_PATHS)} or all")
    return out


def _threads(raw: str | None) -> list[int]:
    if raw:
        return sorted({int(x) for x in raw.split(",") if x.strip()})
    return [1, 2]


def _model_file(model: str | None) -> tuple[Path | None, str]:
    """The model as a path the peers can read (or None), and how to show it."""
    from polyengine.models import default_model_path

    if model is None:
        path = default_model_path()
        return path, f"{path.name} (default, {path})"
    if model.startswith("random:"):
        return None, model
    path = Path(model).expanduser()
    if not path.exists():
        from polyengine.models.hub import parse_hub_name, resolve

        name = parse_hub_name(model)  # the peers read the files the name downloads
        return (None if name is None else resolve(name)), str(model)
    return path, str(model)


def plan(args: argparse.Namespace, notes: list[str]) -> list[Any]:
    """The jobs of this run, in order: polyengine rows, then each peer's settings."""
    from polyengine.benchmarks.host import EMULATIONS, cpu_info, emulated_cpu_info, has_fast_bf16, package_versions
    from polyengine.benchmarks.jobs import Job
    from polyengine.benchmarks.verdicts import is_int8
    from polyengine.errors import InvalidRequest
    from polyengine.plugins import select_backend

    rows: list[Job] = []
    emulate, env = _emulation(args)
    info = emulated_cpu_info(cpu_info(), emulate)
    isas = _isas(getattr(args, "isa", None))
    if emulate:
        want = EMULATIONS[emulate]["isa"]
        if isas not in ([None], [want]):
            raise InvalidRequest(f"--emulate {emulate} runs the CPU kernels on isa {want!r}; drop --isa (or give --isa {want})")
        isas = [want]
    for name in [] if args.backend == ["none"] else args.backend:
        backend = select_backend(name).name  # unknown or unusable: the typed error says why, before any job
        if isas != [None] and backend not in _ISA_BACKENDS:
            notes.append(f"{backend}: --isa not applied, it is an option of {', '.join(_ISA_BACKENDS)} only")
        for dtype in args.dtype:
            for options in _with_isas(_options(args.options), isas, backend):
                if dtype not in (None, "float32") and is_int8(options):
                    notes.append(f"{backend} {dtype} {json.dumps(options, sort_keys=True)}: skipped, int8 weights are "
                                 f"measured in float32 engines only")
                    continue
                setting = f"{backend} {dtype or 'default'}" + (f" {json.dumps(options, sort_keys=True)}" if options else "")
                rows.append(Job(f"polyengine {setting}", "polyengine",
                                dict(model=args.model, backend=backend, dtype=dtype, options=options), "standard",
                                {"system": "polyengine", "setting": setting}, env=env))

    path, _ = _model_file(args.model)
    cache = str(_cache_dir(args.cache_dir))
    for peer in _peers(_peers_arg(args)):
        if peer == "transformers":
            missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
            if missing:
                notes.append(f"transformers: skipped, {' and '.join(missing)} not installed ({_INSTALL['transformers']})")
                continue
            if path is None or not (path.suffix.lower() == ".gguf" or (path / "config.json").is_file()):
                notes.append(f"transformers: skipped, it needs a .gguf file or an HF folder, not {args.model!r}")
                continue
            if not _prepare_transformers(path, cache, notes):
                continue
            dtypes = ["float32"] + (["bfloat16"] if has_fast_bf16(info) else [])
            if emulate and has_fast_bf16(cpu_info()):
                notes.append(f"transformers: float32 only, as on an {emulate}-only host (no bfloat16 units there)")
            for dt in dtypes:
                label = {"float32": "fp32", "bfloat16": "bf16"}[dt]
                rows.append(Job(f"transformers {label}", "transformers",
                                dict(model=str(path), dtype=dt, cache_dir=cache), "standard",
                                {"system": "transformers", "setting": f"{label} generate"}, long=dt == "float32",
                                prefix=dt == "float32", pages=False, env=env))
        else:
            if importlib.util.find_spec("llama_cpp") is None:
                from polyengine.benchmarks.host import llamacpp_install_command

                notes.append("llama.cpp: skipped, llama-cpp-python is not installed; for this CPU build it with: "
                             + llamacpp_install_command(cpu_info()))
                continue
            if path is None or path.suffix.lower() != ".gguf":
                notes.append(f"llama.cpp: skipped, it needs a .gguf file, not {args.model!r}")
                continue
            lib = _llamacpp_lib(getattr(args, "llamacpp_lib", None))
            if emulate and lib is None:
                from polyengine.benchmarks.host import llamacpp_lib_command

                notes.append(f"llama.cpp: skipped, --emulate {emulate} needs its libraries built for that host kind "
                             f"(--llamacpp-lib DIR); build them with: "
                             + llamacpp_lib_command(info, package_versions(("llama_cpp_python",)).get("llama_cpp_python")))
                continue
            lib_env = {**env, "LLAMA_CPP_LIB_PATH": str(lib)} if lib else env
            forbid = list(EMULATIONS[emulate]["llamacpp_forbid"]) if emulate else []
            for i, (quant, file) in enumerate(_llamacpp_files(path, cache, notes, _quants(args.llamacpp_quants))):
                rows.append(Job(f"llama.cpp {quant}", "llamacpp",
                                dict(model=str(file), threads=_threads(args.llamacpp_threads), quant=quant,
                                     forbid=forbid),
                                "standard", {"system": "llama.cpp", "setting": quant}, long=i == 0, prefix=False,
                                pages=False, env=lib_env))
    return rows


def _emulation(args: argparse.Namespace) -> tuple[str | None, dict[str, str]]:
    """``--emulate``: the host kind and the environment every worker and probe runs in."""
    from polyengine.benchmarks.host import EMULATIONS

    kind = getattr(args, "emulate", None)
    return kind, dict(EMULATIONS[kind]["env"]) if kind else {}


def _llamacpp_lib(arg: str | None) -> Path | None:
    """``--llamacpp-lib``: a folder holding libllama.so, resolved; refused up front otherwise."""
    if arg is None:
        return None
    from polyengine.errors import InvalidRequest

    folder = Path(arg).expanduser().resolve()
    if not (folder / "libllama.so").is_file():
        raise InvalidRequest(f"--llamacpp-lib {arg!r}: no libllama.so in {folder}; give the folder a llama.cpp build "
                             f"put its libraries in (its build/bin)")
    return folder


def _with_isas(options: list[dict[str, Any]], isas: list[str | None], backend: str) -> list[dict[str, Any]]:
    """Each option set once per ``--isa`` path (the cpu backend), the path as option ``isa``."""
    from polyengine.errors import InvalidRequest

    if isas == [None] or backend not in _ISA_BACKENDS:
        return options
    if any("isa" in o for o in options):
        raise InvalidRequest("--isa and an --options object with 'isa' both choose the ISA path; give one of them")
    return [{**o, "isa": isa} for o in options for isa in isas]


def _prepare_transformers(path: Path, cache: str, notes: list[str]) -> bool:
    """Convert the GGUF for transformers in a process of its own, before any measured one:
    done inside a worker, the conversion's memory would count in that worker's peak RSS."""
    import subprocess

    from polyengine.benchmarks.run_transformers import cached_folder

    if cached_folder(path, cache)[1]:
        return True
    print(f"converting {path.name} for transformers (once; kept under {cache})...", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, "-m", "polyengine.benchmarks.run_transformers", str(path), cache],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        notes.append(f"transformers: skipped, converting {path.name} failed: {proc.stderr.strip()[-500:]}")
        return False
    return True


_LLAMACPP_QUANTS = frozenset({"shipped", "F16", "F32"})  # the GGUF as shipped and its two copies


def _quants(arg: str | None) -> frozenset[str]:
    if arg is None:
        return _LLAMACPP_QUANTS
    got = frozenset(q.strip() for q in arg.split(",") if q.strip())
    bad = got - _LLAMACPP_QUANTS
    if bad or not got:
        from polyengine.errors import InvalidRequest

        raise InvalidRequest(f"--llamacpp-quants {arg!r}: use a comma-separated subset of shipped, F16, F32")
    return got


def _llamacpp_files(path: Path, cache: str, notes: list[str], quants: frozenset[str] = _LLAMACPP_QUANTS
                    ) -> list[tuple[str, Path]]:
    """The GGUF as shipped plus its F16 and F32 copies (written once, then cached), as
    far as ``quants`` asks for them."""
    from polyengine.benchmarks.gguf_convert import converted_gguf, copy_path
    from polyengine.models.gguf_io import read_gguf

    shipped = _file_type(read_gguf(path).metadata.get("general.file_type"))
    files = [(shipped, path)] if "shipped" in quants else []
    for kind in ("F16", "F32"):
        if kind == shipped or kind not in quants:
            continue
        try:
            if not copy_path(path, kind, cache).is_file():
                print(f"writing the {kind} copy of {path.name} for llama.cpp (once; kept under {cache})...",
                      file=sys.stderr, flush=True)
            files.append((kind, converted_gguf(path, kind, cache)))
        except Exception as exc:  # a failed conversion loses one setting, not the run
            notes.append(f"llama.cpp {kind}: skipped, converting {path.name} failed: {type(exc).__name__}: {exc}")
    return files


def _file_type(value: Any) -> str:
    try:
        import gguf

        return gguf.LlamaFileType(int(value)).name.replace("MOSTLY_", "").replace("ALL_", "")
    except (TypeError, ValueError, ImportError):
        return "as shipped"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Plan, run every job, and return the report document.

    With ``--json`` the document is rewritten after every system, so a long run that
    is stopped keeps what it measured; Ctrl-C stops the run and reports the systems
    that finished (``complete`` is false then).
    """
    from polyengine.benchmarks import host, limits, report, verdicts
    from polyengine.benchmarks.progress import Progress

    work = _workload(args)
    parts, phases = _parts(args.parts)
    emulate, env = _emulation(args)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if repeats < 1:
        from polyengine.errors import InvalidRequest

        raise InvalidRequest(f"--repeats must be at least 1, got {repeats}")
    timeout = args.timeout if args.timeout is not None else (600.0 if args.quick else 7200.0)
    sets = [verdicts.load(path) for path in getattr(args, "targets", None) or []]  # refused before any job
    notes: list[str] = []
    doc: dict[str, Any] = {
        "schema": report.SCHEMA,
        "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "complete": False,
        "host": {"cpu": host.cpu_info(), "load_start": host.load_average(), "versions": host.package_versions(),
                 "torch": host.torch_cpu(env)},  # torch's probe runs before any job, never beside one
        "model": _model_file(args.model)[1],
        "workload": work.to_dict(),
        "parts": parts,
        "phases": list(phases),
        "repeats": repeats,
        "rows": [],
        "notes": notes,
        "targets_from": [s.source for s in sets],
        "target_titles": {s.source: s.title for s in sets},
        "targets": [],
    }
    jobs = plan(args, notes)
    if emulate:
        lib = _llamacpp_lib(getattr(args, "llamacpp_lib", None))
        doc["host"]["emulated"] = {"kind": emulate, "isa": host.emulated_cpu_info(doc["host"]["cpu"], emulate)["isa"],
                                   "env": env, "llamacpp_lib": None if lib is None else str(lib)}
    ours = any(job.kind == "polyengine" for job in jobs)
    if ours:  # the workers load polyengine as installed from a wheel: its modules compiled (load_s)
        code = doc["host"]["bytecode"] = host.compile_bytecode()
        if code["missing"]:
            notes.append(f"{code['missing']} of polyengine's modules have no bytecode and could not be compiled "
                         f"(a read-only tree?): each worker's load time includes compiling them")
    if set(parts) <= {"pages", "served"}:
        pass  # counts and memory of the engine's own settings: no row's share of the host's limits to compute
    elif ours and (work.name in ("standard", "scale") or getattr(args, "isa", None) or emulate):
        # (scale: its quantized files' batch-1 floor is stored_b1_floor_tok_s, their bytes as stored)
        doc["host"]["limits"] = limits.measure(args.model, max(work.batches), env)  # before any job, never beside one
    if args.quick and doc["host"].get("limits"):
        notes.append("host limits measured with --quick (asked for by --isa or --emulate): the quick workload's rates are far "
                     "from them, so its shares only show the columns work")
    served = _served_plan(args, jobs, notes, env) if "served" in parts else None
    for job in jobs:
        job.parts = [p for p in parts if p == "standard" or (p == "long" and job.long) or (p == "prefix" and job.prefix)
                     or (p == "pages" and job.pages)]
        job.phases = phases
    jobs = [job for job in jobs if job.parts]  # the served part runs its own servers, below
    if "prefix" in parts and any(job.kind == "llamacpp" for job in jobs):
        notes.append("llama.cpp: the prefix part is not run for it (its runner has no shared-prefix, multi-turn or "
                     "loaded workloads yet)")
    if "pages" in parts and any(job.kind != "polyengine" for job in jobs):
        notes.append("the pages part runs for polyengine rows alone (paged K/V against full reservations of the same "
                     "engine; the peers have no page pool)")
    progress = Progress(sum(len(job.parts) for job in jobs) + (len(served["systems"]) if served else 0))
    for n in notes:
        progress.note(n)
    probing = bool(doc["host"].get("limits")) and "error" not in doc["host"]["limits"]
    last_read = doc["host"]["limits"].get("read_gb_s") if probing else None  # probed right before the next job
    try:
        if served is not None:  # before the workers' rows: an idle host, the servers one at a time
            doc["served"] = _run_served(served, progress)
            if args.json:
                report.write_json(doc, args.json)
        for job in jobs:
            if probing and last_read is None:
                last_read = limits.measure_read(env)
            doc["rows"].append(_run_row(job, work, repeats, timeout, progress))
            if probing:  # the bandwidth of the minutes this row ran in (limits.for_row; a peer's: limits.drift)
                after = limits.measure_read(env)
                key = "read_probes_gb_s" if job.kind == "polyengine" else "peer_read_probes_gb_s"
                doc["rows"][-1][key] = [last_read, after]
                last_read = after
            _add_paths(doc["rows"][-1], work, doc["host"].get("limits"))
            if doc["rows"][-1].pop("interrupted", False):
                raise KeyboardInterrupt
            doc["host"]["load_end"] = host.load_average()
            doc["targets"] = verdicts.judge(sets, doc["rows"], work, doc["host"].get("limits"))
            if args.json:
                report.write_json(doc, args.json)
        doc["complete"] = True
    except KeyboardInterrupt:
        progress.note("interrupted: reporting the systems that finished")
        notes.append(f"interrupted by the user during system {len(doc['rows'])} of {len(jobs)}")
    doc["host"]["load_end"] = host.load_average()
    doc["targets"] = verdicts.judge(sets, doc["rows"], work, doc["host"].get("limits"))
    moved = limits.drift(doc["host"].get("limits"), doc["rows"])
    if moved:
        notes.append(moved)
    return doc


def _served_plan(args: argparse.Namespace, jobs: list[Any], notes: list[str], env: dict[str, str]) -> dict[str, Any]:
    """The served part's systems: polyengine serve per polyengine row, then llama-server
    on the same GGUF (a note says why not, when it cannot run)."""
    from polyengine.benchmarks import served
    from polyengine.errors import InvalidRequest

    try:
        levels = tuple(int(x) for x in args.served_clients.split(",") if x.strip())
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise InvalidRequest(f"--served-clients takes positive client counts, comma-separated, not {args.served_clients!r}")
    if args.served_requests < 1 or args.served_tokens < 1:
        raise InvalidRequest("--served-requests and --served-tokens must be at least 1")
    if not 0.0 <= args.served_temperature <= 100.0:
        raise InvalidRequest(f"--served-temperature {args.served_temperature} is outside [0, 100]")
    if importlib.util.find_spec("httpx") is None or importlib.util.find_spec("fastapi") is None:
        raise InvalidRequest("the served part needs polyengine's server and an HTTP client: "
                             "pip install 'polyengine[serve]' httpx")
    slots, context = max(levels), SERVED_CONTEXT
    systems = [served.ServedSystem(job.row, served.polyengine_command(
        backend=job.params["backend"], dtype=job.params["dtype"], options=job.params["options"], model=args.model,
        slots=slots, context=context)) for job in jobs if job.kind == "polyengine"]
    binary = served.find_llama_server(getattr(args, "llama_server", None))
    path, _ = _model_file(args.model)
    threads = max(_threads(args.llamacpp_threads))
    if binary is None:
        notes.append("llama-server: not run, none found (--llama-server PATH, $POLYENGINE_LLAMA_SERVER or the PATH; "
                     "docs/benchmarks.md, the served part, says how to build it from llama-cpp-python's source)")
    elif served.model_for_peer(path) is None:
        notes.append(f"llama-server: not run, it needs a .gguf file, not {args.model!r}")
    else:
        systems.append(served.ServedSystem("llama-server", served.llama_server_command(
            binary, model=path, slots=slots, context=context, threads=threads)))
    if not systems:
        notes.append("served: no system to run")
    return {"levels": list(levels), "per_client": args.served_requests, "new_tokens": args.served_tokens,
            "temperature": args.served_temperature,
            "slots": slots, "context": context, "llama_server_threads": threads, "systems": systems, "env": env}


# Each served request: a chat turn of a few dozen tokens and --served-tokens new ones.
SERVED_CONTEXT = 512


def _run_served(plan: dict[str, Any], progress: Any) -> dict[str, Any]:
    from polyengine.benchmarks import served

    for system in plan["systems"]:
        progress.start_job(f"{system.name} (served)")
        served.run_system(system, levels=tuple(plan["levels"]), per_client=plan["per_client"],
                          new_tokens=plan["new_tokens"], env=plan["env"], on_progress=progress.note,
                          temperature=plan.get("temperature", 0.0))
        progress.end_job(system.error)
    judged = served.verdicts(plan["systems"])
    return {**{k: v for k, v in plan.items() if k not in ("systems", "env")},
            "systems": [s.to_dict() for s in plan["systems"]], "verdicts": judged}


def _add_paths(row: dict[str, Any], work: Any, limits: dict[str, Any] | None) -> None:
    """A polyengine row's ISA path and share of the host's limits (report.isa/reached)."""
    from polyengine.benchmarks import report

    if row["kind"] == "polyengine":
        row["isa"] = report.isa(row)
        row["limits_reached"] = report.reached(row, work, limits)


def _run_row(job: Any, work: Any, repeats: int, timeout: float, progress: Any) -> dict[str, Any]:
    """One table row: the job's standard part, then (if that worked) its long and prefix parts."""
    from polyengine.benchmarks.jobs import run_job
    from polyengine.benchmarks.stats import MIB

    row = {"row": job.row, "kind": job.kind, **job.meta, "params": job.params, "details": {},
           "metrics": {}, "errors": {}}
    for part in job.parts:
        job.part = part
        progress.start_job(f"{job.row} ({part})")
        res = run_job(job, workload=work.to_dict(), repeats=repeats, timeout=timeout, on_progress=progress.event)
        if res.get("event") != "result":
            row["errors"][part] = res.get("error", "unknown error")
            row.setdefault("tracebacks", {})[part] = res.get("traceback", "")
            row["metrics"].update(res.get("partial_metrics") or {})  # the phases it finished
            row["details"] = row["details"] or res.get("system") or {}
            row["interrupted"] = bool(res.get("interrupted"))
            progress.end_job(row["errors"][part])
            break  # a system that failed its standard part would fail the long one too
        progress.end_job()
        row["details"] = row["details"] or res.get("system", {})
        row.setdefault("notes", []).extend(res.get("notes") or [])
        if job.kind == "llamacpp" and "threads" in row["details"]:  # the long batch reuses the choice
            job.params["chosen"] = [row["details"]["threads"], row["details"]["threads_batch"]]
        rss = res["peak_rss_bytes"] / MIB
        if part == "long":
            row["metrics"].update(res["metrics"], long_peak_rss_mib=rss)
        elif part == "prefix":
            row["metrics"].update(res["metrics"], prefix_peak_rss_mib=rss)
        elif part == "pages":
            row["metrics"].update(res["metrics"], pages_peak_rss_mib=rss)
        else:
            row["metrics"].update(res["metrics"], peak_rss_mib=rss)
            row["load_seconds"] = res.get("load_seconds")
    d = row["details"]
    if job.kind == "polyengine" and d.get("dtype"):
        row["setting"] = row["setting"].replace(" default", f" {d['dtype']}", 1)
    if job.kind == "transformers" and d.get("threads"):
        row["setting"] += f", {d['threads']} threads"
    if job.kind == "llamacpp" and d.get("threads"):
        row["setting"] += f", threads {d['threads']}/{d['threads_batch']}"
    row["row"] = f"{row['system']} {row['setting']}"
    return row


def _cmd_bench(args: argparse.Namespace) -> int:
    from polyengine.benchmarks import report

    if args.json:  # a report that cannot be written fails now, not after an hour of measuring
        from polyengine.errors import InvalidRequest
        from polyengine.files import check_writable

        check_writable(args.json, what="bench report", error=InvalidRequest)
    doc = run(args)
    print(report.render(doc), flush=True)
    if args.json:
        written = report.write_json(doc, args.json)
        print(f"\nJSON report: {written}", flush=True)
    if not doc["complete"]:
        return 130
    ok = all(not r["errors"] for r in doc["rows"] if r["kind"] == "polyengine")
    return 0 if ok else 1
