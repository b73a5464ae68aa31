"""Run hostile cases in a child process, under a memory limit and a deadline.

A test module registers cases with :func:`case`: a function ``fn(tmp: Path)`` that
feeds polyengine one hostile input, and the typed error it must end in (or ``None``
when it must simply work), with words its message must contain. :func:`run_cases`
runs them in one child Python (``RLIMIT_AS`` set before it starts, so a case that
would take all memory gets a ``MemoryError`` instead, which fails the test; a case
that hangs is killed at the deadline, which fails it too) and returns what each did.
The child writes its results to a file, not stdout, so a case that prints (a hostile
plugin) cannot garble them.

Run as a script it is that child: ``python hostile_runner.py MODULE TMP RESULTS NAME...``.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
# Enough for the interpreter, NumPy, tokenizers and a tiny model; far below what any
# unbounded case would take. Counted as address space (what `ulimit -v` limits).
MEMORY_LIMIT = 3 * 1024**3


@dataclass(frozen=True)
class Case:
    fn: Callable[[Path], Any]
    expect: type | None  # the error it must end in; None: it must return
    words: tuple[str, ...]
    seconds: float


def case(expect: type | None, *words: str, seconds: float = 15.0) -> Callable:
    """Register ``fn`` in its module's ``CASES``: it must raise ``expect`` (a subclass
    is fine) whose message holds every one of ``words``, within ``seconds``."""

    def register(fn: Callable[[Path], Any]) -> Callable[[Path], Any]:
        module = sys.modules[fn.__module__]
        module.__dict__.setdefault("CASES", {})[fn.__name__] = Case(fn, expect, words, seconds)
        return fn

    return register


def _limit(memory: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return apply


def run_cases(
    module: str,
    tmp: Path,
    names: list[str] | None = None,
    *,
    memory: int = MEMORY_LIMIT,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run ``module``'s cases (all, or ``names``) in one child; ``{name: result}``.

    A result has ``outcome`` ("returned" or "raised"), ``type``, ``typed`` (a
    PolyengineError), ``message``, ``seconds`` and ``traceback``; a case the child never
    finished (it hung or killed the process) has ``outcome`` "did not finish".
    """
    mod = importlib.import_module(module)
    names = list(mod.CASES) if names is None else names
    results_file = tmp / f"results-{module}.jsonl"
    results_file.unlink(missing_ok=True)
    child_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
                 **(env or {})}
    cmd = [sys.executable, str(Path(__file__).resolve()), module, str(tmp), str(results_file), *names]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env,
                              preexec_fn=_limit(memory), errors="replace")
        tail = f"exit {proc.returncode}; stderr: {proc.stderr[-3000:]}"
    except subprocess.TimeoutExpired as exc:
        tail = f"killed after {timeout} s; stderr: {(exc.stderr or b'')[-3000:]!r}"
    done = {}
    if results_file.exists():
        for line in results_file.read_text().splitlines():
            row = json.loads(line)
            done[row["name"]] = row
    for name in names:
        done.setdefault(name, {"name": name, "outcome": "did not finish", "type": None, "typed": False,
                               "message": tail, "seconds": None, "traceback": ""})
    return done


def check(module: str, results: dict[str, dict[str, Any]]) -> list[str]:
    """What went wrong, one line per case that did not end as registered (empty: all good)."""
    mod = importlib.import_module(module)
    problems = []
    for name, row in results.items():
        spec: Case = mod.CASES[name]
        where = f"{name}: "
        if row["outcome"] == "did not finish":
            problems.append(where + "did not finish (hang, crash or silent exit): " + row["message"])
            continue
        if spec.expect is None:
            if row["outcome"] != "returned":
                problems.append(where + f"should work but raised {row['type']}: {row['message']}\n{row['traceback']}")
        elif row["outcome"] != "raised":
            problems.append(where + f"should raise {spec.expect.__name__} but returned")
        elif not row["typed"] or spec.expect.__name__ not in row["mro"]:
            problems.append(where + f"raised {row['type']}, expected {spec.expect.__name__}: {row['message']}\n"
                            + row["traceback"])
        else:
            missing = [w for w in spec.words if w.lower() not in row["message"].lower()]
            if missing:
                problems.append(where + f"message lacks {missing}: {row['message']}")
        if row["seconds"] is not None and row["seconds"] > spec.seconds:
            problems.append(where + f"took {row['seconds']:.1f} s, bound {spec.seconds} s")
    return problems


def _child(module: str, tmp: Path, results: Path, names: list[str]) -> None:
    from polyengine.errors import PolyengineError

    mod = importlib.import_module(module)
    for name in names:
        folder = tmp / name
        folder.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        row: dict[str, Any] = {"name": name, "outcome": "returned", "type": None, "typed": False, "mro": [],
                               "message": "", "traceback": ""}
        try:
            mod.CASES[name].fn(folder)
        except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are findings too
            row.update(outcome="raised", type=f"{type(exc).__module__}.{type(exc).__qualname__}",
                       typed=isinstance(exc, PolyengineError), mro=[c.__name__ for c in type(exc).__mro__],
                       message=str(exc), traceback="".join(traceback.format_exception(exc))[-4000:])
        row["seconds"] = time.monotonic() - start
        with open(results, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=True) + "\n")


if __name__ == "__main__":
    _child(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
