"""A live ``polyengine serve`` in a subprocess on a free loopback port, for the tests.

The server is started with ``--port 0`` and announces the port it got on stderr, so
there is no race for a port. Every wait is bounded; a server that does not come up
fails the test with its log.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).parent
_LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


class LiveServer:
    def __init__(self, args: list[str], log: Path, *, test_backends: bool = False, env: dict | None = None,
                 port: int = 0, start_timeout: float = 60.0):
        entry = [str(HERE / "serve_test_backends.py")] if test_backends else ["-m", "polyengine.serving"]
        cmd = [sys.executable, *entry, "--port", str(port), "--log-level", "warning", *args]
        self.log_path = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, cwd=HERE)
        self.url = self._wait_for_url(start_timeout)
        self.api = self.url + "/v1"

    def _wait_for_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _LISTENING.search(self.log())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"server did not start (exit {self.proc.returncode}):\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[tuple, float]:
        """``{(name, (label, value), ...): value}`` from /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, *sorted(s.labels.items()))] = s.value
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"server ignored signal {sig} for {timeout}s:\n{self.log()}") from None
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
