"""A command's flags from environment variables and a TOML config file.

A command that opts in (``polyengine serve``) reads each of its ``--flags`` from three
places besides the command line, by one rule:

- the environment variable ``POLYENGINE_`` + the flag's name upper-cased with ``-`` as
  ``_`` (``--port`` -> ``POLYENGINE_PORT``, ``--max-slots`` -> ``POLYENGINE_MAX_SLOTS``);
- a key of the config file named as the flag without its dashes (``port = 8000``,
  ``max-slots = 8``; ``max_slots`` is the same key). The file is ``--config PATH``, else
  ``$POLYENGINE_CONFIG``, else ``<user config dir>/polyengine/<command>.toml`` when it
  exists (``$XDG_CONFIG_HOME``, default ``~/.config``);
- the flag's default.

The first of flag, environment, config file, default that is set wins. A switch
(``--no-tools``) takes ``1/true/yes/on`` or ``0/false/no/off`` from the environment and
a TOML boolean from the file; a repeatable flag (``--option``) takes its values
separated by spaces from the environment and a list from the file (``--option`` also
takes a table: ``option = {isa = "avx2"}``). Each value goes through the flag's own type
and choices. An unknown key in the file, or a value the flag refuses, is an
:class:`InvalidRequest` naming the key and where it came from. Environment variables
that name no flag of the command are left alone (other parts of polyengine read
``POLYENGINE_*`` variables of their own).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from polyengine.errors import InvalidRequest

__all__ = ["env_name", "config_path", "apply_env_and_config", "add_config_arg"]

CONFIG_ENV = "POLYENGINE_CONFIG"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_SKIP = {"help", "version", "config"}


def env_name(flag: str) -> str:
    """``--max-slots`` -> ``POLYENGINE_MAX_SLOTS``."""
    return "POLYENGINE_" + flag.lstrip("-").upper().replace("-", "_")


def config_path(command: str) -> Path:
    """The default config file of ``command``: ``<user config dir>/polyengine/<command>.toml``
    (:func:`polyengine.cache.config_root`, absolute even without a home)."""
    from polyengine.cache import config_root

    return config_root() / f"{command}.toml"


def add_config_arg(p: argparse.ArgumentParser, command: str, *, exclude: Sequence[str] = ()) -> None:
    """Add ``--config`` to ``p`` and read its other flags (but the ``exclude``d ones)
    from the environment and the config file when it parses (``p`` is a
    :class:`polyengine.cli.Parser`, which calls ``defaults_hook``)."""
    p.add_argument("--config", metavar="PATH", default=None,
                   help=f"a TOML file of this command's flags (default: ${CONFIG_ENV}, else {config_path(command)} "
                        f"if it exists); every flag also reads ${env_name('--FLAG-NAME')} (precedence: flag > "
                        f"environment > config file > default)")
    p.defaults_hook = lambda parser, argv: apply_env_and_config(  # type: ignore[attr-defined]
        parser, argv, command, exclude=exclude)


def _flags(parser: argparse.ArgumentParser, exclude: Sequence[str]) -> dict[str, argparse.Action]:
    """Each long flag's name (without dashes) -> its action."""
    out = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and action.dest not in _SKIP and longs[0][2:] not in exclude:
            out[longs[0][2:]] = action
    return out


def _config_from_argv(argv: Sequence[str]) -> str | None:
    for i, word in enumerate(argv):
        if word == "--":
            break
        if word == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith("--config="):
            return word.partition("=")[2]
    return None


def _read_config(path: Path) -> dict[str, Any]:
    import tomllib

    from polyengine.files import open_regular

    def unreadable(msg: str) -> InvalidRequest:
        return InvalidRequest(f"config file {path}: {msg}")

    with open_regular(path, what="config file", error=unreadable) as f:
        data = f.read(1 << 20)
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise InvalidRequest(f"config file {path} is not valid TOML: {exc}") from None


def apply_env_and_config(parser: argparse.ArgumentParser, argv: Sequence[str], command: str, *,
                         exclude: Sequence[str] = ()) -> None:
    """Set ``parser``'s defaults from the config file and the environment (see the
    module docstring); the command line, parsed afterwards, overrides both."""
    flags = _flags(parser, exclude)
    explicit = _config_from_argv(argv) or os.environ.get(CONFIG_ENV) or None
    path = Path(explicit).expanduser() if explicit else config_path(command)
    values: dict[str, Any] = {}
    if explicit or path.is_file():
        for key, value in _read_config(path).items():
            name = key.replace("_", "-")
            if name in exclude:
                raise InvalidRequest(f"config file {path}: key {key!r} is not read from a config file; pass "
                                     f"--{name} or its own environment variable", field=key)
            if name not in flags:
                close = difflib.get_close_matches(name, list(flags), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise InvalidRequest(f"config file {path}: unknown key {key!r}{hint}; the keys are the flags of "
                                     f"`polyengine {command}` without their dashes", field=key)
            values[name] = _convert(flags[name], value, f"config file {path}: key {key!r}", from_env=False)
    for name, action in flags.items():
        raw = os.environ.get(env_name(name))
        if raw is not None and raw != "":
            values[name] = _convert(action, raw, f"environment variable {env_name(name)}", from_env=True)
    parser.set_defaults(**{flags[name].dest: value for name, value in values.items()})


def _convert(action: argparse.Action, value: Any, where: str, *, from_env: bool) -> Any:
    """``value`` as the command line would have produced it for ``action``."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if from_env:
            word = value.strip().lower()
            if word not in _TRUE + _FALSE:
                raise InvalidRequest(f"{where}={value!r}: use one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}")
            on = word in _TRUE
        elif isinstance(value, bool):
            on = value
        else:
            raise InvalidRequest(f"{where}: expected true or false, got {value!r}")
        return on if isinstance(action, argparse._StoreTrueAction) else not on
    if isinstance(action, argparse._AppendAction):
        if from_env:
            items: list[Any] = value.split()
        elif isinstance(value, Mapping):
            items = [f"{k}={json.dumps(v)}" for k, v in value.items()]
        elif isinstance(value, list):
            items = value
        else:
            items = [value]
        return [_one(action, item, where) for item in items]
    if isinstance(value, (dict, list)) or (isinstance(value, bool) and action.type is not None):
        raise InvalidRequest(f"{where}: expected a single value, got {value!r}")
    return _one(action, value, where)


def _one(action: argparse.Action, value: Any, where: str) -> Any:
    text = value if isinstance(value, str) else json.dumps(value) if isinstance(value, bool) else str(value)
    try:
        converted = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"{where}: {value!r} is not valid for {action.option_strings[-1]} ({exc})") from None
    if action.choices is not None and converted not in action.choices:
        raise InvalidRequest(f"{where}: {value!r} is not one of {', '.join(map(repr, action.choices))}")
    return converted
