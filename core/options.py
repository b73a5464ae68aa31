"""Backend options: the table an engine declares, and the one check every engine uses.

An engine's ``OPTIONS`` maps each option name (a key of ``EngineConfig.options``) to an
:class:`Option`: its default, what it means, and what values it accepts. A plain value
instead of an ``Option`` is a default with no other constraint. :func:`check_options`
refuses unknown keys, values of another type than the default's (an int is accepted for
a float; a string is never read as a number or a boolean), values outside ``choices``,
below ``minimum`` or above ``maximum`` (NaN, infinities and, without a ``maximum``,
magnitudes over :data:`MAX_OPTION_NUMBER` always), values nested deeper than
``MAX_JSON_DEPTH``, and
whatever the option's own ``check`` says, each with an :class:`InvalidRequest` that names
the option, the backend and what would be accepted (its ``field`` is ``options.<key>``). It imports no framework, so a
leader that forwards options to remote engines (the Ray engine) checks them with the
same table before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from polyengine.errors import InvalidRequest
from polyengine.limits import MAX_JSON_DEPTH, json_depth
from polyengine.validation import is_int

__all__ = ["Option", "check_options", "option_defaults", "MAX_OPTION_NUMBER"]

MAX_OPTION_NUMBER = 2**31 - 1  # the bound on a number option that declares no maximum


@dataclass(frozen=True)
class Option:
    """One backend option: ``default`` (its type is the option's type; None accepts any
    value), ``help`` (one line for ``polyengine backends --verbose`` and errors),
    ``choices`` (the allowed values), ``minimum``/``maximum`` (inclusive bounds for
    numbers), ``check`` (a function of the value returning an error text, or None)."""

    default: Any
    help: str = ""
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    check: Callable[[Any], str | None] | None = None

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` for this option, or None."""
        default = self.default
        want = type(default)
        typed = (
            default is None
            or (want is bool and isinstance(value, bool))
            or (want is int and is_int(value))
            or (want is float and (is_int(value) or isinstance(value, float)))
            or (want not in (bool, int, float) and isinstance(value, want))
            # choices of several types ("auto", True, False): a value of one of their types
            or (self.choices is not None and any(type(value) is type(c) for c in self.choices))
        )
        if not typed and self.choices is not None and len({type(c) for c in self.choices}) > 1:
            return f"use one of {', '.join(repr(c) for c in self.choices)}"
        if not typed:
            return f"must be a {want.__name__} (like its default {default!r})"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if value != value or abs(value) == float("inf"):
                return "must be a finite number"
            if self.maximum is None and abs(value) > MAX_OPTION_NUMBER:
                # no option means anything that large; it would only overflow an int32 or a wait
                return f"must be at most {MAX_OPTION_NUMBER:,} in size"
        if self.choices is not None and value not in self.choices:
            return f"use one of {', '.join(repr(c) for c in self.choices)}"
        if self.minimum is not None and value < self.minimum:
            return f"must be >= {self.minimum:g}"
        if self.maximum is not None and value > self.maximum:
            return f"must be <= {self.maximum:g}"
        return self.check(value) if self.check is not None else None


def _as_option(spec: Any) -> Option:
    return spec if isinstance(spec, Option) else Option(spec)


def option_defaults(table: Mapping[str, Any]) -> dict[str, Any]:
    """Every option of ``table`` at its default."""
    return {key: _as_option(spec).default for key, spec in table.items()}


def _owners(names: list[str], backend: str) -> str:
    """Where ``names`` are options of other installed backends: "; 'isa' is an option of
    backend 'cpu' (--backend cpu)", so a refusal says which backend has what was asked
    for. Read from the plugins' option tables (modules that import no framework)."""
    from polyengine.discovery import list_backends

    found: dict[str, list[str]] = {}
    for info in list_backends():
        if info.name != backend and not info.broken:
            for name in set(names) & set(info.option_table()):
                found.setdefault(name, []).append(info.name)
    return "".join(f"; {name!r} is an option of backend {' and '.join(map(repr, owners))} (--backend {owners[0]})"
                   for name, owners in sorted(found.items()))


def option_rows(table: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A backend's option table as rows (name, default, help, choices) for listings
    (``polyengine backends --verbose``)."""
    rows = []
    for key, spec in table.items():
        o = _as_option(spec)
        rows.append({"name": key, "default": o.default, "help": getattr(o, "help", "") or "",
                     "choices": list(o.choices) if getattr(o, "choices", None) else None})
    return rows


def check_options(table: Mapping[str, Any], options: Mapping[str, Any], *, backend: str) -> dict[str, Any]:
    """``options`` checked against ``table``, with every unset option at its default.

    Raises :class:`InvalidRequest` naming the option and the backend for an unknown key
    (listing the known ones with their defaults) or a refused value."""
    unknown = sorted(set(options) - set(table))
    if unknown:
        known = ", ".join(f"{k} (default {_as_option(v).default!r})" for k, v in table.items()) or "none"
        raise InvalidRequest(f"unknown option(s) {unknown} for backend {backend!r}{_owners(unknown, backend)}; its "
                             f"options: {known}", field=f"options.{unknown[0]}")
    checked = {}
    for key, value in options.items():
        spec = _as_option(table[key])
        if json_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:  # before comparing it with anything (recursive)
            raise InvalidRequest(f"option {key} of backend {backend!r}: the value nests more than {MAX_JSON_DEPTH} "
                                 f"levels", field=f"options.{key}")
        if isinstance(spec.default, tuple) and isinstance(value, list):
            value = tuple(value)  # JSON (--option, --options, a config file) has lists, not tuples
        problem = spec.problem(value)
        if problem is not None:
            raise InvalidRequest(f"option {key}={value!r} of backend {backend!r}: {problem}", field=f"options.{key}")
        checked[key] = value
    return {**option_defaults(table), **checked}
