"""The ``polyengine`` command line.

``backends``, ``generate`` and ``chat`` are the core's own commands. Commands that live
outside the core (``conformance``, ``bench``, ``serve``, ...) register through the
entry-point group ``polyengine.commands``: each entry point is a function
``add_command(subparsers)`` that adds its sub-parser and sets ``func``. Loading one runs
through :func:`polyengine.isolation.call_plugin` (bounded in time, output captured,
``SystemExit``/``KeyboardInterrupt`` caught): a command whose module fails to load is
still listed, running it reports the error, and the other commands keep working.

``--json`` output is only ever JSON: while such a command runs, anything else written
to standard output, from Python or at the file-descriptor level, by any thread (a
plugin's prints), goes to standard error instead. A real Ctrl-C exits with 130. A reader
that closes the output early (``polyengine generate ... | head -c1``) ends the command
quietly with 141, the status of a command the closed pipe stopped (128 + SIGPIPE).

``polyengine backends`` imports no torch or jax: it only reads plugin specs and runs
their cheap probes. ``--verbose`` also calls each available backend's ``diagnose``
(what an engine would run here: device, ISA, kernel and int8 paths, fallbacks with their
fix), which imports its framework.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from typing import Any, Iterator, Sequence

from polyengine._version import PROTOCOL_VERSION, __version__
from polyengine.errors import PolyengineError

__all__ = ["main", "build_parser"]


class Parser(argparse.ArgumentParser):
    """The command line's parser, and every sub-command's (plugins' too: sub-parsers
    are made of their parent's class). A long option is never matched by a prefix
    (``--max-token`` is an error, not ``--max-tokens``), and an argument a sub-command
    does not know is reported with that sub-command's usage, with the closest option
    it does know."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    # A command that reads its flags from elsewhere too (polyengine.cli_config) sets
    # this: called with the parser and its arguments before they are parsed.
    defaults_hook: Any = None

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None):  # type: ignore[override]
        if self.defaults_hook is not None:
            self.defaults_hook(self, list(sys.argv[1:] if args is None else args))
        return super().parse_known_args(args, namespace)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = self
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction):
                    owner = action.choices.get(getattr(parsed, action.dest or "", None), self)
            owner.error(f"unrecognized arguments: {' '.join(extras)}{_did_you_mean(owner, extras)}")
        return parsed


def _did_you_mean(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    import difflib

    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    for word in extras:
        if word.startswith("--"):
            close = difflib.get_close_matches(word.partition("=")[0], known, n=1)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="polyengine",
        description="Hardware-agnostic LLM inference: one engine protocol, pluggable backends.",
    )
    parser.add_argument(
        "--version", action="version",
        version=f"polyengine {__version__} (engine protocol {PROTOCOL_VERSION})",
    )
    from polyengine import cli_run

    cli_run.add_verbosity_args(parser, dest_prefix="top_")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("backends", help="list installed backends and whether they can run here")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="also what each available backend would run here: device, ISA, kernel and int8 paths, "
                        "and the reason and fix for any fallback (imports the frameworks; may build kernels)")
    p.set_defaults(func=_cmd_backends, clean_json=True)

    cli_run.add_commands(sub)
    _add_plugin_commands(sub)
    return parser


COMMANDS_GROUP = "polyengine.commands"


def _add_plugin_commands(sub: Any) -> None:
    import importlib.metadata as md

    from polyengine.errors import PluginError
    from polyengine.isolation import call_plugin, describe_failure

    for ep in sorted(md.entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        if ep.name in sub.choices:
            continue  # the same distribution visible twice on sys.path, or a core command
        call = call_plugin(lambda ep=ep: ep.load()(sub))
        if call.ok:
            continue
        dist = getattr(getattr(ep, "dist", None), "metadata", {}).get("Name") if getattr(ep, "dist", None) else None
        err = PluginError(ep.name, dist, describe_failure(call, f"command {ep.name!r} ({ep.value})"))

        def fail(args: argparse.Namespace, err: PluginError = err) -> int:
            raise err

        if ep.name in sub.choices:  # it got as far as adding its parser before failing
            sub.choices[ep.name].set_defaults(func=fail)
            continue
        p = sub.add_parser(ep.name, help="(broken: run it to see why)", add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=fail)


def _cmd_backends(args: argparse.Namespace) -> int:
    from polyengine.discovery import list_backends

    infos = list_backends()
    rows = [b.to_dict() for b in infos]
    if args.verbose:
        from polyengine.options import option_rows

        for info, row in zip(infos, rows):
            row["paths"] = info.diagnose()
            row["weights"] = _weights_row(info)
            row["options"] = option_rows(info.option_table())
    if args.json:
        json.dump(rows, args.out, indent=2)
        args.out.write("\n")
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
    for r in rows if args.verbose else ():
        if r["paths"] or r["options"] or r["weights"]:
            print(f"\n{r['name']}:")
            for key, value in r["paths"].items():
                print(f"  {key}: {value}")
            if r["weights"]:
                print(f"  weight formats: {r['weights']}")
        if r["options"]:
            print("  options (--option KEY=VALUE):")
            for o in r["options"]:
                print(f"    {o['name']}={o['default']!r}: {o['help']}")
    return 0


def _weights_row(info) -> str:
    """Which weight formats a backend computes on as stored and which the loader converts
    for it (its spec's ``weight_formats``), in one line for ``backends --verbose``; a
    table that cannot be read is reported in the line, never raised."""
    from polyengine.models.blocks import FORMATS

    if not info.usable:
        return ""
    convert = ("to float32 at load, one tensor at a time (then to the compute dtype; a ggml type the gguf "
               "package cannot dequantize: WeightsError)")
    try:
        table = info.weight_formats()
    except Exception as exc:  # noqa: BLE001 - a plugin's bug, reported as such
        return f"error: its weight_formats table cannot be read ({type(exc).__name__}: {exc})"
    if table is None:
        return (f"not declared in its spec (its engines' Capabilities.weight_formats decide: the float formats "
                f"unless they say more); converts every other format {convert}")
    unknown = [f for f in table if f not in FORMATS]
    if unknown:
        return f"error: its weight_formats table names unknown formats {unknown}"
    blocks = [f for f in table if not FORMATS[f].is_float]
    others = [f for f in FORMATS if f not in table]
    on = f"computes on {', '.join(blocks)} blocks and" if blocks else "computes on"
    on += " the float formats" if all(f in table for f in FORMATS if FORMATS[f].is_float) else (
        f" {', '.join(f for f in table if FORMATS[f].is_float)}")
    return f"{on} as stored; converts {', '.join(others) + ' and ' if others else ''}GGUF's other types {convert}"


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send everything written to standard output meanwhile to standard error: Python's
    ``sys.stdout`` and, when it is the process's file descriptor 1, the descriptor too
    (so C-level writes and stray threads are caught as well)."""
    real = sys.stdout
    try:
        fd = real.fileno()
        err_fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # captured streams (tests, notebooks)
        fd = err_fd = None
    real.flush()
    saved = None
    if fd is not None:
        saved = os.dup(fd)
        os.dup2(err_fd, fd)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = real
        if saved is not None:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)


# 128 + SIGPIPE: what a shell reports for a command that a closed pipe stopped.
EXIT_BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly. Standard output is pointed at
        # /dev/null so that the interpreter's last flush at exit cannot fail again.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return EXIT_BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    real_stdout = sys.stdout
    buffer = io.StringIO()
    try:
        # Plugins are imported while the parser is built: if --json may be asked for,
        # whatever they print must not reach standard output.
        with _stdout_to_stderr() if "--json" in argv else contextlib.nullcontext():
            parser = build_parser()
            args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        # The core's --json commands write their JSON to args.out; everything else meanwhile
        # goes to standard error. Other commands keep standard output as it is.
        clean = bool(getattr(args, "json", False) and getattr(args, "clean_json", False))
        args.out = buffer if clean else sys.stdout
        from polyengine.cli_run import verbosity
        from polyengine.logs import cli_logging

        with cli_logging(verbosity(args)), _stdout_to_stderr() if clean else contextlib.nullcontext():
            code = int(args.func(args) or 0)
    except PolyengineError as exc:
        print(f"polyengine: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    real_stdout.write(buffer.getvalue())
    real_stdout.flush()
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
