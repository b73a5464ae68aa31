"""Tolerances as data: per-dtype defaults, per-test overrides, per-backend overrides.

The suite ships ``tolerances.toml`` (``[dtype.NAME]`` tables plus ``[[override]]``
entries); a backend ships a file of ``[[override]]`` entries only, named by its
``BackendSpec.tolerances`` (``"package:resource"``) or given to subclass mode as the
``conformance_tolerances`` fixture. Every override names a ``quantity``, a ``value``
and a ``reason``, and may narrow itself with ``test``, ``dtype`` and ``model``;
an override without a reason, with an unknown quantity, test or model, or a value
that is not a positive number is refused with :class:`ConformanceConfigError`.

Lookup order, first match wins: the backend's overrides (most specific first), the
suite's overrides (most specific first), the suite's dtype default. The returned
:class:`Tolerance` says where its value came from, and the report records it.
"""

from __future__ import annotations

import importlib.resources
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["QUANTITIES", "DEFAULTS_RESOURCE", "ConformanceConfigError", "Tolerance", "Tolerances", "OptionSet",
           "read_resource", "option_sets", "parse_option", "SuiteVariable", "suite_environment"]

DEFAULTS_RESOURCE = "polyengine.conformance:tolerances.toml"

QUANTITIES = {
    "logits_rel_l2": "relative L2 error of a logits row against the reference (float64)",
    "logprob_abs": "absolute error of a reported raw log-prob against the reference",
    "kv_rel_l2": "relative L2 error of exported K/V against the reference's export",
    "bucket_rel_l2": "relative L2 difference of prefill logits between bucket configurations",
    "tie_gap": "a token that differs from the reference's is a near tie (reported, not "
               "failed) when the reference's top-1/top-2 score gap is below this",
    "support_slack": "probability by which a filter boundary (top-p mass, min-p ratio, a near-tied "
                     "k-th value) may move when judging a sample: a token within it of a boundary is "
                     "reported, not failed, by the support test, and left out of the goodness of fit "
                     "(which stays exact, false-failure rate ALPHA = 1e-4 per check)",
}
_SELECTORS = ("test", "dtype", "model")
_ENTRY_KEYS = {"quantity", "value", "reason", *_SELECTORS}


class ConformanceConfigError(ValueError):
    """A tolerance or xfail file is malformed; the message names the file and entry."""


@dataclass(frozen=True)
class Tolerance:
    quantity: str
    value: float
    source: str  # where the value came from, e.g. "suite default [dtype.float32]"
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"quantity": self.quantity, "value": self.value, "source": self.source}
        if self.reason:
            out["reason"] = self.reason
        return out


@dataclass(frozen=True)
class _Override:
    quantity: str
    value: float
    reason: str
    origin: str
    test: str | None = None
    dtype: str | None = None
    model: str | None = None

    @property
    def specificity(self) -> int:
        return sum(getattr(self, k) is not None for k in _SELECTORS)

    def matches(self, test: str, dtype: str, model: str | None) -> bool:
        return (
            self.test in (None, test)
            and self.dtype in (None, dtype)
            and (self.model is None or self.model == model)
        )

    def describe(self) -> str:
        where = ", ".join(f"{k}={getattr(self, k)}" for k in _SELECTORS if getattr(self, k) is not None)
        return f"{self.origin} [[override]]" + (f" ({where})" if where else "")


def read_resource(name: str | Path) -> tuple[str, str]:
    """Read a ``"package:resource"`` name or a file path; return (text, label)."""
    if isinstance(name, Path) or (":" not in str(name)) or Path(str(name)).is_file():
        path = Path(name)
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except OSError as exc:
            raise ConformanceConfigError(f"cannot read {path}: {exc}") from None
    package, _, resource = str(name).partition(":")
    try:
        return importlib.resources.files(package).joinpath(resource).read_text(encoding="utf-8"), str(name)
    except (ModuleNotFoundError, FileNotFoundError, OSError) as exc:
        raise ConformanceConfigError(
            f"cannot read {name!r} (package {package!r}, resource {resource!r}): {exc}; ship the "
            f"file as package data of {package!r}"
        ) from None


@dataclass(frozen=True)
class OptionSet:
    """Engine options the suite runs a backend with (``EngineConfig.options``), and how
    its results are judged: ``lossless`` ones exactly as without options (the dtype's
    tolerances), the others under ``tolerances`` (quantity -> value, each a floor on the
    value the usual lookup gives). Declared in a backend's tolerance file as
    ``[[conformance_options]]``, or given to the runner (``--option k=v``)."""

    options: tuple[tuple[str, Any], ...]
    lossless: bool = True
    tolerances: tuple[tuple[str, float], ...] = ()
    reason: str = ""
    origin: str = ""

    @property
    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.options)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.options)

    def to_dict(self) -> dict[str, Any]:
        return {"options": self.as_dict(), "lossless": self.lossless, "tolerances": dict(self.tolerances),
                "reason": self.reason, "origin": self.origin}


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def _parse_option_sets(data: Mapping[str, Any], origin: str) -> list[OptionSet]:
    entries = data.get("conformance_options", [])
    if not isinstance(entries, list):
        raise ConformanceConfigError(f"{origin}: 'conformance_options' must be an array of tables ([[conformance_options]])")
    out: list[OptionSet] = []
    for i, entry in enumerate(entries, 1):
        where = f"{origin}: conformance_options #{i}"
        if not isinstance(entry, dict):
            raise ConformanceConfigError(f"{where} must be a table")
        unknown = set(entry) - {"options", "lossless", "tolerances", "reason"}
        if unknown:
            raise ConformanceConfigError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: lossless, options, "
                                         f"reason, tolerances")
        options, reason = entry.get("options"), entry.get("reason")
        if not isinstance(options, dict) or not options:
            raise ConformanceConfigError(f"{where}: options must be a non-empty table of engine options, e.g. "
                                         f"options = {{ quantize = \"int8\" }}")
        if not isinstance(reason, str) or not reason.strip():
            raise ConformanceConfigError(f"{where} has no reason: say why this option set is worth checking")
        lossless = entry.get("lossless", False)
        if not isinstance(lossless, bool):
            raise ConformanceConfigError(f"{where}: lossless must be true or false")
        tolerances = entry.get("tolerances", {})
        if not isinstance(tolerances, dict):
            raise ConformanceConfigError(f"{where}: tolerances must be a table of quantity = value")
        if lossless and tolerances:
            raise ConformanceConfigError(f"{where}: a lossless option set is compared exactly as without options; "
                                         f"drop its tolerances or set lossless = false")
        if not lossless and not tolerances:
            raise ConformanceConfigError(f"{where}: a lossy option set (lossless = false) declares the tolerances "
                                         f"it is compared under (tolerances = {{ logits_rel_l2 = ..., ... }})")
        for quantity, value in tolerances.items():
            if quantity not in QUANTITIES:
                raise ConformanceConfigError(f"{where}: unknown quantity {quantity!r}; known: {', '.join(QUANTITIES)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConformanceConfigError(f"{where}: tolerance {quantity} must be a positive number, got {value!r}")
        out.append(OptionSet(tuple(sorted((k, _freeze(v)) for k, v in options.items())), lossless,
                             tuple(sorted((q, float(v)) for q, v in tolerances.items())), reason.strip(), origin))
    labels = [o.options for o in out]
    if len(set(labels)) != len(labels):
        raise ConformanceConfigError(f"{origin}: the same option set is declared twice")
    return out


def _composed(key: tuple[tuple[str, Any], ...], declared: Sequence[OptionSet]) -> OptionSet | None:
    """Options no entry declares whole but declared sets cover between them (each part's
    options all among ``key``, every option of ``key`` in some part): judged as their
    composition, lossless only if every part is, each tolerance the largest any part
    declares (``kv_dtype=bfloat16`` with the lossless ``page_size=16``: kv_dtype's). None
    when the declared sets do not cover ``key``."""
    given = set(key)
    parts = [o for o in declared if o.options and set(o.options) <= given]
    if not parts or set().union(*(set(o.options) for o in parts)) != given:
        return None
    tolerances: dict[str, float] = {}
    for part in parts:
        for quantity, value in part.tolerances:
            tolerances[quantity] = max(value, tolerances.get(quantity, value))
    labels = " + ".join(f"[{o.label}]" for o in parts)
    return OptionSet(key, all(o.lossless for o in parts), tuple(sorted(tolerances.items())),
                     f"no entry declares these options together; judged as the composition of the declared sets "
                     f"{labels}: " + "; ".join(o.reason for o in parts if o.reason), f"composed of {labels}")


def option_sets(source: str | Path | Mapping[str, Any] | None) -> list[OptionSet]:
    """The option sets a backend's tolerance file declares (``[[conformance_options]]``)."""
    if source is None:
        return []
    data, origin = _load(source)
    return _parse_option_sets(data, origin)


@dataclass(frozen=True)
class SuiteVariable:
    """An environment variable a backend asks the runner to set for its suite's process
    (``[[suite_environment]]`` in its tolerance file): compile-time settings that suit the
    suite's tiny models, never something a result depends on. The user's own value wins;
    with ``append`` the value is a flag joined to the user's value (``XLA_FLAGS``) unless
    a flag of that name is there already."""

    name: str
    value: str
    append: bool = False
    reason: str = ""

    def apply(self, current: str | None) -> str:
        """The variable's value in the suite's process, given its value now."""
        if not current:
            return self.value
        if not self.append:
            return current
        flag = self.value.split("=", 1)[0]
        if any(word.split("=", 1)[0] == flag for word in current.split()):
            return current
        return f"{current} {self.value}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "append": self.append, "reason": self.reason}


def _parse_suite_environment(data: Mapping[str, Any], origin: str) -> list[SuiteVariable]:
    entries = data.get("suite_environment", [])
    if not isinstance(entries, list):
        raise ConformanceConfigError(f"{origin}: 'suite_environment' must be an array of tables ([[suite_environment]])")
    out: list[SuiteVariable] = []
    for i, entry in enumerate(entries, 1):
        where = f"{origin}: suite_environment #{i}"
        if not isinstance(entry, dict):
            raise ConformanceConfigError(f"{where} must be a table")
        unknown = set(entry) - {"name", "value", "append", "reason"}
        if unknown:
            raise ConformanceConfigError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: append, name, reason, value")
        name, value, reason = entry.get("name"), entry.get("value"), entry.get("reason")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConformanceConfigError(f"{where}: name must be an environment variable's name, e.g. name = \"XLA_FLAGS\"")
        if not isinstance(value, str) or not value.strip() or "\0" in value:
            raise ConformanceConfigError(f"{where}: value must be a non-empty string")
        if not isinstance(reason, str) or not reason.strip():
            raise ConformanceConfigError(f"{where} has no reason: say why the suite runs with {name} set")
        append = entry.get("append", False)
        if not isinstance(append, bool):
            raise ConformanceConfigError(f"{where}: append must be true or false")
        if any(v.name == name for v in out):
            raise ConformanceConfigError(f"{where}: {name} is declared twice; write its flags in one value")
        out.append(SuiteVariable(name, value.strip(), append, reason.strip()))
    return out


def suite_environment(source: str | Path | Mapping[str, Any] | None) -> list[SuiteVariable]:
    """The environment a backend's tolerance file asks its suite to run with
    (``[[suite_environment]]``; `polyengine conformance` sets it, docs/conformance.md)."""
    if source is None:
        return []
    data, origin = _load(source)
    return _parse_suite_environment(data, origin)


def parse_option(text: str) -> tuple[str, Any]:
    """``k=v`` of the runner's ``--option``: the value read as TOML (``3``, ``true``,
    ``"int8"``, ``[8, 16]``), else taken as a plain string (``int8``)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConformanceConfigError(f"--option {text!r}: write it as KEY=VALUE, e.g. --option quantize=int8")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.strip(), _freeze(value)


def _load(source: str | Path | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    if isinstance(source, Mapping):
        return dict(source), "<dict>"
    text, label = read_resource(source)
    try:
        return tomllib.loads(text), label
    except tomllib.TOMLDecodeError as exc:
        raise ConformanceConfigError(f"{label}: not valid TOML: {exc}") from None


def _parse_overrides(
    data: Mapping[str, Any], origin: str, known_tests: set[str], known_models: set[str]
) -> list[_Override]:
    entries = data.get("override", [])
    if not isinstance(entries, list):
        raise ConformanceConfigError(f"{origin}: 'override' must be an array of tables ([[override]])")
    out: list[_Override] = []
    for i, entry in enumerate(entries, 1):
        where = f"{origin}: override #{i}"
        if not isinstance(entry, dict):
            raise ConformanceConfigError(f"{where} must be a table")
        unknown = set(entry) - _ENTRY_KEYS
        if unknown:
            raise ConformanceConfigError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_ENTRY_KEYS)}")
        reason = entry.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise ConformanceConfigError(
                f"{where} has no reason: every tolerance override must say why (reason = \"...\")"
            )
        quantity = entry.get("quantity")
        if quantity not in QUANTITIES:
            raise ConformanceConfigError(f"{where}: unknown quantity {quantity!r}; known: {', '.join(QUANTITIES)}")
        value = entry.get("value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConformanceConfigError(f"{where}: value must be a positive number, got {value!r}")
        test, model, dtype = entry.get("test"), entry.get("model"), entry.get("dtype")
        if test is not None and test not in known_tests:
            raise ConformanceConfigError(f"{where}: test {test!r} is not a test of this suite; known: {', '.join(sorted(known_tests))}")
        if model is not None and model not in known_models:
            raise ConformanceConfigError(f"{where}: model {model!r} is not a test model; known: {', '.join(sorted(known_models))}")
        if dtype is not None and not isinstance(dtype, str):
            raise ConformanceConfigError(f"{where}: dtype must be a string")
        out.append(_Override(quantity, float(value), reason.strip(), origin, test, dtype, model))
    keys = [(o.quantity, o.test, o.dtype, o.model) for o in out]
    dupes = {k for k in keys if keys.count(k) > 1}
    if dupes:
        raise ConformanceConfigError(f"{origin}: several overrides for the same (quantity, test, dtype, model): {sorted(dupes, key=str)}")
    # Most specific first; a stable sort keeps file order among equals (they never
    # overlap exactly, per the check above).
    return sorted(out, key=lambda o: -o.specificity)


class Tolerances:
    """The suite's defaults plus one backend's overrides."""

    def __init__(
        self,
        backend: str | Path | Mapping[str, Any] | None = None,
        *,
        known_tests: Iterable[str],
        known_models: Iterable[str],
        defaults: str | Path | Mapping[str, Any] = DEFAULTS_RESOURCE,
    ):
        tests, models = set(known_tests), set(known_models)
        data, self.defaults_origin = _load(defaults)
        self.dtypes: dict[str, dict[str, float]] = {}
        for dtype, table in (data.get("dtype") or {}).items():
            missing = set(QUANTITIES) - set(table)
            extra = set(table) - set(QUANTITIES)
            if missing or extra:
                raise ConformanceConfigError(
                    f"{self.defaults_origin} [dtype.{dtype}]: missing {sorted(missing)}, unknown {sorted(extra)}"
                )
            self.dtypes[dtype] = {q: float(v) for q, v in table.items()}
        self.suite_overrides = _parse_overrides(data, self.defaults_origin, tests, models)
        self.backend_origin: str | None = None
        self.backend_overrides: list[_Override] = []
        self.option_sets: list[OptionSet] = []
        self.suite_environment: list[SuiteVariable] = []
        if backend is not None:
            bdata, self.backend_origin = _load(backend)
            if "dtype" in bdata:
                raise ConformanceConfigError(
                    f"{self.backend_origin}: a backend's tolerance file holds only [[override]] entries "
                    f"(each with a reason), not [dtype.*] tables"
                )
            extra = set(bdata) - {"override", "conformance_options", "suite_environment"}
            if extra:
                raise ConformanceConfigError(f"{self.backend_origin}: unknown top-level key(s) {sorted(extra)}; "
                                             f"allowed: override, conformance_options, suite_environment")
            self.backend_overrides = _parse_overrides(bdata, self.backend_origin, tests, models)
            self.option_sets = _parse_option_sets(bdata, self.backend_origin)
            self.suite_environment = _parse_suite_environment(bdata, self.backend_origin)
        self.active: OptionSet | None = None

    def use_options(self, options: Mapping[str, Any]) -> OptionSet | None:
        """Judge this run as one with engine ``options``: under the tolerances of the
        declared option set with exactly these options, else (options the backend does
        not declare a set for, e.g. the runner's ``--option``) as lossless."""
        if not options:
            self.active = None
            return None
        key = tuple(sorted((k, _freeze(v)) for k, v in options.items()))
        declared = [o for o in self.option_sets if o.options == key]
        self.active = declared[0] if declared else (_composed(key, self.option_sets) or OptionSet(
            key, True, (), "given to the runner (--option); no [[conformance_options]] entry of the backend declares "
                           "it, so it is judged as lossless", "--option"))
        return self.active

    def get(self, quantity: str, *, test: str, dtype: str, model: str | None = None) -> Tolerance:
        if quantity not in QUANTITIES:  # a suite bug, not a backend's
            raise KeyError(f"unknown tolerance quantity {quantity!r}")
        usual = self._usual(quantity, test=test, dtype=dtype, model=model)
        floor = dict(self.active.tolerances).get(quantity) if self.active is not None else None
        if floor is None or floor <= usual.value:
            return usual
        return Tolerance(quantity, floor, f"option set [{self.active.label}]: {self.active.origin} "
                         f"[[conformance_options]]", self.active.reason)

    def _usual(self, quantity: str, *, test: str, dtype: str, model: str | None) -> Tolerance:
        for overrides, who in ((self.backend_overrides, "backend"), (self.suite_overrides, "suite")):
            for o in overrides:
                if o.quantity == quantity and o.matches(test, dtype, model):
                    return Tolerance(quantity, o.value, f"{who} override: {o.describe()}", o.reason)
        table = self.dtypes.get(dtype)
        if table is None:
            raise ConformanceConfigError(
                f"no default tolerance for dtype {dtype!r} (the suite knows {', '.join(self.dtypes)}); "
                f"add [[override]] entries with quantity = {quantity!r}, dtype = {dtype!r} and a reason "
                f"to the backend's tolerance file"
            )
        return Tolerance(quantity, table[quantity], f"suite default: {self.defaults_origin} [dtype.{dtype}]")
