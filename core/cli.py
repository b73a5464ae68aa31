"""The ``polyengine`` command line.

``backends``, ``generate`` and ``chat`` are the core's own commands. Commands that live
outside the core (``conformance``, ``bench``, ``serve``, ...) register through the
entry-point group ``polyengine.commands``: each entry point is a function
``add_command(subparsers)`` that adds its sub-parser and sets ``func``. A command whose
module fails to import is still listed, and running it reports the error; the other
commands keep working.

``polyengine backends`` imports no torch or jax: it only reads plugin specs and runs
their cheap probes.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from polyengine._version import PROTOCOL_VERSION, __version__
from polyengine.errors import PolyengineError

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polyengine",
        description="Hardware-agnostic LLM inference: one engine protocol, pluggable backends.",
    )
    parser.add_argument(
        "--version", action="version",
        version=f"polyengine {__version__} (engine protocol {PROTOCOL_VERSION})",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("backends", help="list installed backends and whether they can run here")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=_cmd_backends)

    from polyengine import cli_run

    cli_run.add_commands(sub)
    _add_plugin_commands(sub)
    return parser


COMMANDS_GROUP = "polyengine.commands"


def _add_plugin_commands(sub: Any) -> None:
    import importlib.metadata as md

    from polyengine.errors import PluginError

    for ep in sorted(md.entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        if ep.name in sub.choices:
            continue  # the same distribution visible twice on sys.path, or a core command
        try:
            ep.load()(sub)
        except Exception as exc:  # a broken command must not take the others down
            dist = getattr(getattr(ep, "dist", None), "metadata", {}).get("Name") if getattr(ep, "dist", None) else None
            err = PluginError(ep.name, dist, f"command {ep.name!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}")
            p = sub.add_parser(ep.name, help=f"(broken: {exc})", add_help=False)
            p.add_argument("rest", nargs="*")

            def fail(args: argparse.Namespace, err: PluginError = err) -> int:
                raise err

            p.set_defaults(func=fail)


def _cmd_backends(args: argparse.Namespace) -> int:
    from polyengine.plugins import list_backends

    rows = [b.to_dict() for b in list_backends()]
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if not rows:
        print("no backends installed (the built-in ones come with `pip install polyengine`)")
        return 0
    headers = ("name", "status", "accelerator", "priority", "distribution", "detail")
    table = []
    for r in rows:
        status = "BROKEN" if r["broken"] else "excluded" if r["excluded"] else (
            ("available (by name)" if r["by_name_only"] else "available") if r["available"] else "unavailable")
        detail = r["error"] if r["broken"] else r["reason"]
        if not r["available"] and not r["broken"] and not r["excluded"] and r["install_hint"]:
            detail = f"{detail} (fix: {r['install_hint']})"
        table.append((r["name"], status, "yes" if r["accelerator"] else "no",
                      "" if r["priority"] is None else str(r["priority"]), r["distribution"] or "", detail or ""))
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers[:-1])]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)) + "  " + headers[-1])
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except PolyengineError as exc:
        print(f"polyengine: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
