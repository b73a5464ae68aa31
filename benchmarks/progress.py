"""Progress while the benchmark runs: one live status line on a terminal, plain lines otherwise.

It writes to stderr, so stdout carries only the table (and can be redirected to a
file or a pipe without progress noise).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    def __init__(self, total_jobs: int, stream: TextIO | None = None, live: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.total = total_jobs
        self.index = 0
        self.label = ""
        self.started = time.perf_counter()
        self.job_started = self.started

    def _write(self, text: str) -> None:
        if self.live:
            # \r + erase line: the status line is rewritten in place.
            self.stream.write("\r\x1b[2K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def start_job(self, label: str) -> None:
        self.index += 1
        self.label = label
        self.job_started = time.perf_counter()
        self._write(f"[{self.index}/{self.total}] {label}: starting")

    def event(self, phase: str, detail: str) -> None:
        elapsed = time.perf_counter() - self.job_started
        self._write(f"[{self.index}/{self.total}] {self.label}: {phase}, {detail} ({elapsed:.0f} s)")

    def end_job(self, error: str | None = None) -> None:
        elapsed = time.perf_counter() - self.job_started
        status = f"FAILED: {error}" if error else "done"
        text = f"[{self.index}/{self.total}] {self.label}: {status} in {elapsed:.1f} s"
        if self.live:
            self.stream.write("\r\x1b[2K" + text + "\n")
            self.stream.flush()
        else:
            self._write(text)

    def note(self, text: str) -> None:
        """A line that stays (a skipped peer, a conversion)."""
        if self.live:
            self.stream.write("\r\x1b[2K")
        self.stream.write(text + "\n")
        self.stream.flush()
