"""What a conformance report's differential runs must show: the programs really ran
the calls the layer exists for (tests/test_conformance_honest.py, test_conformance_cli.py)."""

from __future__ import annotations


def assert_programs_exercised(tests) -> None:
    """Every differential configuration's programs compared tokens and refusals, and used
    prefixes the way the two prefix rules allow: after later prefills, and again after
    an insert (docs/design.md, Prefixes)."""
    from polyengine.conformance.layer_differential import PROGRAMS, SHAPE_MODELS

    runs = {t["id"]: t.get("statistics", {}).get("programs", {}) for t in tests if t["id"].startswith("test_differential")}
    ran = {t["id"] for t in tests if t["id"].startswith("test_differential") and t["status"] == "passed"}
    runs = {k: v for k, v in runs.items() if k in ran}  # skipped: an architecture the backend does not declare
    assert len(runs) >= 5 and len(runs) <= len(PROGRAMS), sorted(runs)
    for test_id, counts in runs.items():
        if test_id.split("[")[1].split("-")[0].rstrip("]") not in SHAPE_MODELS:  # a few programs per architecture
            assert counts.get("tokens compared", 0) > 0, f"{test_id}: no tokens compared: {counts}"
            continue
        for what in ("tokens compared", "refusals compared", "prefixes inserted after later prefills",
                     "prefixes inserted after an insert", "results read after the next step"):
            assert counts.get(what, 0) > 0, f"{test_id}: no {what} in its programs: {counts}"
