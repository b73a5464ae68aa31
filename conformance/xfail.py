"""A backend's known failures: a strict xfail file with a reason for every entry.

Format (TOML)::

    [xfail]
    "test_greedy_matches_reference[odd_qwen2-bfloat16]" = "bf16 flips a near tie at step 3 (issue 12)"
    "test_sampling_parameter[repetition_penalty]" = "penalties land in 0.3"

A key is a test id as the report prints it (``name[params]``) or a bare test name,
which covers all its parametrizations. Entries are strict: a listed test that passes
fails the run (XPASS), so the file never goes stale, and an entry that matches no test
of the suite is an error, so a typo cannot hide a failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from polyengine.conformance.tolerances import ConformanceConfigError, _load

__all__ = ["XfailList"]


@dataclass
class XfailList:
    entries: dict[str, str]  # test id or bare name -> reason
    origin: str = "<none>"

    @classmethod
    def load(cls, source: str | Path | Mapping[str, Any] | None) -> "XfailList":
        if source is None:
            return cls({})
        data, origin = _load(source)
        extra = set(data) - {"xfail"}
        if extra:
            raise ConformanceConfigError(f"{origin}: unknown top-level key(s) {sorted(extra)}; expected an [xfail] table")
        table = data.get("xfail", {})
        if not isinstance(table, dict):
            raise ConformanceConfigError(f"{origin}: [xfail] must be a table of \"test id\" = \"reason\"")
        for test, reason in table.items():
            if not isinstance(reason, str) or not reason.strip():
                raise ConformanceConfigError(
                    f"{origin}: xfail entry {test!r} has no reason; write \"{test}\" = \"why it fails\""
                )
        return cls({k: v.strip() for k, v in table.items()}, origin)

    def check_against(self, test_ids: Iterable[str]) -> None:
        """Raise if an entry matches none of the suite's tests (ids as ``name[params]``)."""
        ids = set(test_ids)
        names = {i.split("[", 1)[0] for i in ids}
        stale = sorted(e for e in self.entries if e not in ids and e not in names)
        if stale:
            raise ConformanceConfigError(
                f"{self.origin}: xfail entr{'y' if len(stale) == 1 else 'ies'} {stale} match no test of "
                f"the suite; fix the name or remove the entry (test ids look like {sorted(ids)[:3]})"
            )

    def reason_for(self, test_id: str) -> str | None:
        if test_id in self.entries:
            return self.entries[test_id]
        return self.entries.get(test_id.split("[", 1)[0])
