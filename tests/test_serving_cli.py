"""The serve command: its entry point, its arguments, and what it refuses to start with."""

from __future__ import annotations

import argparse
import importlib.metadata
import socket
import subprocess
import sys

from polyengine.serving.cli import add_command

from imports import assert_imports_light


def test_serve_registers_through_the_commands_entry_point_with_loopback_defaults():
    (ep,) = [e for e in importlib.metadata.entry_points(group="polyengine.commands") if e.name == "serve"]
    assert ep.load() is add_command
    parser = argparse.ArgumentParser()
    add_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", "random:tiny"])
    assert (args.host, args.port, args.api_key, args.replicas) == ("127.0.0.1", 8000, None, None)
    assert callable(args.func)


def test_the_command_imports_no_web_stack_until_it_runs():
    assert_imports_light("import polyengine.serving.cli, polyengine.serving",
                         heavy=("fastapi", "uvicorn", "prometheus_client", "ray", "starlette"))


def _serve(*args):
    return subprocess.run([sys.executable, "-m", "polyengine.serving", *args], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


def test_bad_settings_fail_fast_with_a_message():
    out = _serve("--model", "random:tiny", "--max-slots", "0")
    assert out.returncode == 1 and "--max-slots must be at least 1" in out.stderr
    out = _serve("--model", "random:tiny", "--replicas", "2", "--port", "0")
    assert out.returncode == 1 and "--port 0 is not supported with --replicas" in out.stderr
    out = _serve("--model", "random:tiny", "--backend", "nosuch", "--port", "0")
    assert out.returncode == 1 and "no backend named 'nosuch'" in out.stderr


def test_a_taken_port_is_reported_before_the_model_loads():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        out = _serve("--model", "random:tiny", "--port", str(s.getsockname()[1]))
    assert out.returncode == 1 and "cannot listen on 127.0.0.1" in out.stderr
    assert "loading" not in out.stderr
