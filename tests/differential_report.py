"""What a conformance report's differential runs must show: the programs really ran
the calls the layer exists for (tests/test_conformance_honest.py, test_conformance_cli.py)."""

from __future__ import annotations

from polyengine.conformance.layer_differential import PROGRAMS

# What every configuration's programs must have done on an engine that declares token
# masks, and what the programs of all configurations together must have done.
_MASKS_EACH = ("prefill masks", "generate masks", "masks beside overrides", "masks excluding the unmasked pick",
               "tokens checked against their mask", "mask refusals compared")
_MASKS_ALL = ("prefill masks continuing a prefix", "bulk_insert samples under the prefix's mask")


def assert_programs_exercised(tests, *, token_masks: bool = False) -> None:
    """Every differential configuration's programs compared tokens and refusals, and used
    prefixes the way the two prefix rules allow: after later prefills, and again after
    an insert (docs/design.md, Prefixes); with ``token_masks`` declared, they also drew
    masks on every path and refused bad ones."""
    runs = {t["id"]: t.get("statistics", {}).get("programs", {}) for t in tests if t["id"].startswith("test_differential")}
    assert len(runs) == len(PROGRAMS), sorted(runs)
    each = ("tokens compared", "refusals compared", "prefixes inserted after later prefills",
            "prefixes inserted after an insert", "results read after the next step")
    for test_id, counts in runs.items():
        for what in each + (_MASKS_EACH if token_masks else ()):
            assert counts.get(what, 0) > 0, f"{test_id}: no {what} in its programs: {counts}"
    for what in _MASKS_ALL if token_masks else ():
        assert sum(c.get(what, 0) for c in runs.values()) > 0, f"no {what} in any configuration's programs"
