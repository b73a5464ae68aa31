"""Shape rules the cpu and cuda_torch backends keep (issue: the CPU as a backend of its
own): no function over 60 lines, and the plan never imports the engine that runs it
(one resolution, read by the engine; the engine/paths import cycle is gone)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted([*ROOT.glob("backends/cpu/*.py"), *ROOT.glob("backends/cuda_torch/*.py"),
                ROOT / "backends" / "torch_common" / "engine.py"])


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_over_60_lines(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60]
    assert not long, f"{path.name}: {', '.join(long)}"


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_the_plan_and_options_never_import_an_engine():
    for name in ("plan.py", "options.py", "kernels.py", "int8.py"):
        assert not {m for m in _imports(ROOT / "backends" / "cpu" / name)
                    if m.startswith("polyengine.backends.") and m.endswith(".engine")}, name
    for backend in ("cpu", "cuda_torch"):  # option tables are read without starting torch
        assert "torch" not in _imports(ROOT / "backends" / backend / "options.py")


def test_backends_never_import_each_other():
    for own, other in (("cpu", "cuda_torch"), ("cuda_torch", "cpu")):
        for path in (ROOT / "backends" / own).glob("*.py"):
            assert not {m for m in _imports(path) if m.startswith(f"polyengine.backends.{other}")}, path
