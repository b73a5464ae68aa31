"""Every relative link in README.md and docs/ resolves: the file exists, and a ``#anchor``
names a heading of the target (GitHub's slugs: lower case, punctuation dropped, spaces
to hyphens, ``-1``, ``-2`` for repeats). Links to the web and mail are not followed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^()\s]+(?:\([^()\s]*\))?)\)")  # [text](target), not images
_FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str, inline_code: bool = False) -> str:
    """``text`` without fenced code blocks, and without inline code unless
    ``inline_code`` (links in code are examples; a heading's code is part of its slug)."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line if inline_code else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text(encoding="utf-8"), inline_code=True).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [m.group(1) for m in _LINK.finditer(_prose(page.read_text(encoding="utf-8")))]


def test_the_slugs_follow_githubs_rule():
    assert slug("Prefill on bfloat16 operands") == "prefill-on-bfloat16-operands"
    assert slug("Options (`EngineConfig.options`; `polyengine bench --options`)") == \
        "options-engineconfigoptions-polyengine-bench---options"
    assert slug("int8 weights: memory") == "int8-weights-memory"
    assert "the-device-check-polyengine-device-check" in anchors(ROOT / "docs" / "benchmarks.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if ROOT in dest.parents else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)
