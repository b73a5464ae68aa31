"""Hostile inputs, class "one plugin takes every command down": plugins that exit,
raise KeyboardInterrupt, hang, print, or return malformed specs at import or in their
hooks and probes. Each is listed as broken, names itself once, and leaves the other
backends, commands and ``--json`` output working; discovery of a hanging plugin is
bounded by ``POLYENGINE_PLUGIN_TIMEOUT``.

The plugins are real distributions pip-installed into a folder only child processes
see; every child runs under a memory limit and a wall-clock timeout.
"""

from __future__ import annotations

import json
import time

import pytest

from hostile_plugins import Dist, install, polyengine, python

TIMEOUT_ENV = {"POLYENGINE_PLUGIN_TIMEOUT": "1"}

BACKENDS = {
    "exits": "import sys\nsys.exit(3)\n",
    "interrupts": "raise KeyboardInterrupt\n",
    "sleeps": "import time\ntime.sleep(3600)\n",
    "prints": '''
        import os, sys
        print("HELLO FROM PRINTS AT IMPORT")
        print("to stderr", file=sys.stderr)
        os.write(1, b"RAW FD WRITE AT IMPORT\\n")

        @hookimpl
        def polyengine_backends():
            print("HELLO FROM PRINTS IN ITS HOOK")
            return [spec("prints_ok")]
        ''',
    "twobad": '''
        @hookimpl
        def polyengine_backends():
            bad = dict(description="d", protocol_version=PROTOCOL_VERSION, probe=lambda: Probe(True), factory="m:f")
            return [BackendSpec(name=None, **bad), BackendSpec(name="", **bad)]
        ''',
    "hook_exits": '''
        import sys

        @hookimpl
        def polyengine_backends():
            sys.exit("bye from a hook")
        ''',
    "hook_sleeps": '''
        import time

        @hookimpl
        def polyengine_backends():
            time.sleep(3600)
        ''',
    "probe_sleeps": '''
        import time

        def probe():
            time.sleep(3600)

        @hookimpl
        def polyengine_backends():
            return [spec("slow_probe", probe=probe)]
        ''',
    "probe_exits": '''
        def probe():
            raise SystemExit(9)

        @hookimpl
        def polyengine_backends():
            return [spec("exiting_probe", probe=probe)]
        ''',
    "impostor": '''
        @hookimpl
        def polyengine_backends():
            return [spec("reference")]
        ''',
    "tools_raise": '''
        @hookimpl
        def polyengine_tools():
            raise RuntimeError("tools exploded")

        @hookimpl
        def polyengine_models():
            raise RuntimeError("models exploded")
        ''',
    "factory_exits": '''
        def create(*, model, config):
            raise SystemExit("factory says bye")

        @hookimpl
        def polyengine_backends():
            return [BackendSpec(name="exiting_factory", description="d", protocol_version=PROTOCOL_VERSION,
                                probe=lambda: Probe(True), factory=create)]
        ''',
    "good": '''
        @hookimpl
        def polyengine_backends():
            return [spec("good_one")]
        ''',
}
COMMANDS = {
    "cmd_exits": "import sys\nsys.exit(4)\n",
    "cmd_interrupts": "raise KeyboardInterrupt\n",
    "cmd_sleeps": "import time\ntime.sleep(3600)\n",
    "cmd_prints": '''
        print("HELLO FROM A COMMAND")

        def add_command(sub):
            print("HELLO FROM add_command")
            p = sub.add_parser("hello", help="says hello")
            p.set_defaults(func=lambda args: print("hello") or 0)
        ''',
}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-plugins")
    backends = {f"hostile_{k}": f"hostile_pkg.{k}" for k in BACKENDS}
    commands = {k.removeprefix("cmd_").replace("_", "-"): f"hostile_cmds.{k}:add_command" for k in COMMANDS}
    return install(root, [
        Dist("hostile-backends", "hostile_pkg", BACKENDS, {"polyengine.backends": backends}),
        Dist("hostile-commands", "hostile_cmds", COMMANDS, {"polyengine.commands": commands}),
    ])


def test_every_broken_plugin_is_listed_broken_and_names_itself_once(site):
    start = time.monotonic()
    proc = polyengine(site, "backends", "--json", env=TIMEOUT_ENV)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}  # stdout is pure JSON: no plugin prints in it
    assert "HELLO" not in proc.stdout and "RAW FD" not in proc.stdout
    for plugin, words in {
        "hostile_exits": ["sys.exit", "3"],
        "hostile_interrupts": ["KeyboardInterrupt"],
        "hostile_sleeps": ["did not finish", "1"],
        "hostile_hook_exits": ["sys.exit", "bye from a hook"],
        "hostile_hook_sleeps": ["did not finish"],
    }.items():
        row = rows[plugin]
        assert row["broken"] and not row["available"], row
        assert row["error"].count(f"'{plugin}'") == 1 and "hostile-backends" in row["error"], row["error"]
        for word in words:
            assert word in row["error"], (plugin, row["error"])
    # Two malformed specs: one entry for the plugin, naming it once and both problems.
    bad = [r for r in rows.values() if r["broken"] and "hostile_twobad" in r["error"]]
    assert len(bad) == 1 and bad[0]["error"].count("hostile_twobad") == 1, bad
    assert "2 malformed spec(s)" in bad[0]["error"] and "None" in bad[0]["error"] and "''" in bad[0]["error"]
    assert "probe" in rows["slow_probe"]["error"] and rows["slow_probe"]["broken"]
    assert "sys.exit" in rows["exiting_probe"]["error"] and rows["exiting_probe"]["broken"]
    assert rows["good_one"]["available"] and rows["prints_ok"]["available"]
    assert rows["reference"]["broken"] and "hostile_impostor" in rows["reference"]["error"]
    # Each hanging import, hook and probe costs at most the 1 s bound, not an hour.
    assert elapsed < 30


def test_other_backends_and_commands_keep_working(site):
    env = {**TIMEOUT_ENV, "POLYENGINE_BACKENDS": "good,hostile_good,hostile_exits,hostile_interrupts,"
           "hostile_sleeps,hostile_prints,hostile_twobad,hostile_tools_raise,hostile_factory_exits,"
           "good_one,prints_ok,exiting_factory"}
    proc = polyengine(site, "generate", "--backend", "good_one", "--model", "random:tiny",
                      "--max-tokens", "3", "--seed", "1", "--json", "hi", env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["token_ids"]) == 3
    proc = polyengine(site, "generate", "--backend", "exiting_factory", "--model", "random:tiny",
                      "--max-tokens", "1", "hi", env=env)
    assert proc.returncode == 1 and "exiting_factory" in proc.stderr and "factory says bye" in proc.stderr
    proc = polyengine(site, "hello", env=TIMEOUT_ENV)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("hello"), proc.stderr
    proc = polyengine(site, "--help", env=TIMEOUT_ENV)
    assert proc.returncode == 0 and "backends" in proc.stdout
    for name, word in (("exits", "sys.exit"), ("interrupts", "KeyboardInterrupt"), ("sleeps", "did not finish")):
        proc = polyengine(site, name, env=TIMEOUT_ENV)
        assert proc.returncode == 1 and word in proc.stderr and "hostile-commands" in proc.stderr, proc.stderr


def test_a_real_ctrl_c_still_stops_discovery(site):
    """SIGINT from the user (not a plugin's KeyboardInterrupt) still ends the command, with 130."""
    # As in a terminal, SIGINT raises KeyboardInterrupt: a test run started as a background
    # job inherits SIGINT ignored (POSIX shells do that), and Python then leaves it ignored.
    # The Ctrl-C comes once the CLI is imported (on a busy machine importing it can take
    # longer than the delay, and the point is discovery); a hang dumps every thread's stack.
    script = (
        "import faulthandler, os, signal, threading, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "faulthandler.dump_traceback_later(25, exit=True)\n"
        "from polyengine.cli import main\n"
        "threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()\n"
        "sys.exit(main(['backends']))\n"
    )
    start = time.monotonic()
    proc = python(site, "-c", script, env={"POLYENGINE_PLUGIN_TIMEOUT": "30"})
    assert proc.returncode == 130, (proc.returncode, proc.stderr)
    assert time.monotonic() - start < 20
