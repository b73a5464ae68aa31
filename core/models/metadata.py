"""One validation layer for every value read from a model file.

Model files are untrusted input (``docs/security.md``): a ``config.json``, a GGUF
header, a safetensors header or a shard index may hold any JSON or any bytes. The
parsers in this package never use such a value directly; they read it through here:

- :func:`read_json` reads a JSON file with its size bounded before reading, its
  nesting depth bounded, duplicate keys and NaN/Infinity refused;
- :class:`Fields` gives each value in its allowed form (an integer in a range, a
  finite number, ``true``/``false``, a string, a list of them), or raises the error the
  caller names (:class:`ModelConfigError` for configs, :class:`WeightsError` for
  weights files) with the file, the key, the allowed form and what was found;
- :func:`contained_file` keeps a file name taken from metadata inside the model's
  folder;
- :func:`require_finite` refuses NaN and infinite weights, naming the tensor.

What was found is quoted shortened (:func:`shown`), so an error never echoes a large
or foreign value. The limits themselves live in :mod:`polyengine.limits`.
"""

from __future__ import annotations

import builtins
import json
import math
import os
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Mapping

import numpy as np

from polyengine.errors import ModelConfigError, WeightsError
from polyengine.files import open_regular
from polyengine.limits import MAX_JSON_BYTES, MAX_JSON_DEPTH, json_depth

__all__ = ["Fields", "MISSING", "read_json", "json_depth", "contained_file", "require_finite", "shown"]

MISSING: Any = object()
_SHOWN = 60  # characters of a bad value quoted in an error


def shown(value: Any) -> str:
    """A short, safe rendering of a value for an error message."""
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return f"a {type(value).__name__} of {len(value)} items"
    if isinstance(value, dict) and len(value) > 8:
        return f"an object of {len(value)} keys"
    if isinstance(value, str) and len(value) > _SHOWN:
        return repr(value[:_SHOWN]) + f"... ({len(value):,} characters)"
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, np.integer)):
        return "an integer"
    if isinstance(value, (float, np.floating)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _no_duplicates(what: str, error: Callable[[str], Exception]) -> Callable[[list], dict]:
    def hook(pairs: list) -> dict:
        out = {}
        for key, value in pairs:
            if key in out:
                raise error(f"{what}: key {shown(key)} appears twice in one object; which one is meant is ambiguous")
            out[key] = value
        return out

    return hook


def read_json(
    path: str | Path,
    *,
    max_bytes: int = MAX_JSON_BYTES,
    error: Callable[..., Exception] = ModelConfigError,
    what: str = "file",
) -> Any:
    """Decode a JSON file, refusing (as ``error``) one over ``max_bytes``, nested deeper
    than :data:`MAX_JSON_DEPTH`, with a repeated key, NaN or Infinity, or not UTF-8."""
    path = Path(path)
    fail = (lambda msg: error(msg, file=path)) if error is WeightsError else (lambda msg: error(f"{path}: {msg}"))
    with open_regular(path, what=what, error=fail) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise fail(f"the {what} is {size:,} bytes; at most {max_bytes // 1024**2} MiB is accepted (corrupt or not a {what})")
        try:
            raw = f.read(max_bytes + 1)
        except OSError as exc:
            raise fail(f"cannot read the {what}: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:
        raise fail(f"the {what} grew past {max_bytes // 1024**2} MiB while being read")

    def constant(name: str) -> Any:
        raise fail(f"{name} is not valid JSON (numbers must be finite)")

    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(str(path), fail), parse_constant=constant)
    except UnicodeDecodeError as exc:
        raise fail(f"the {what} is not UTF-8 text (byte {exc.start}); the file is corrupt") from None
    except RecursionError:
        raise fail(f"the {what} is nested more than {MAX_JSON_DEPTH} levels deep; real ones nest a few levels") from None
    except json.JSONDecodeError as exc:
        raise fail(f"the {what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if json_depth(data, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise fail(f"the {what} is nested more than {MAX_JSON_DEPTH} levels deep; real ones nest a few levels")
    return data


class Fields:
    """Typed, bounded access to one file's metadata (a mapping read from JSON or GGUF).

    Every accessor takes the key and a default (``MISSING``: the key is required) and
    returns the value in its allowed form, or raises ``error`` naming ``source``, the
    key (``prefix`` + key), the allowed form and what was found. A key present with
    value ``null`` counts as absent, as transformers treats it.
    """

    def __init__(self, data: Mapping[str, Any], source: str, *, error: Callable[..., Exception] = ModelConfigError,
                 prefix: str = ""):
        self.data, self.source, self.error, self.prefix = data, str(source), error, prefix

    def fail(self, key: str, form: str, value: Any = MISSING) -> Exception:
        found = "it is missing" if value is MISSING else f"got {_kind(value)} {shown(value)}"
        msg = f"{self.prefix}{key} must be {form}; {found}"
        if self.error is WeightsError:
            return WeightsError(msg, file=self.source)
        return self.error(f"{self.source}: {msg}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str, default: Any = MISSING) -> Any:
        value = self.data.get(key)
        if value is None:
            if default is MISSING:
                raise self.fail(key, "present", MISSING)
            return default
        return value

    def integer(self, key: str, default: Any = MISSING, *, min: int | None = None, max: int | None = None) -> Any:
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return value
        return self.check_int(key, value, min=min, max=max)

    def check_int(self, key: str, value: Any, *, min: int | None = None, max: int | None = None, form: str = "") -> int:
        form = form or "an integer" + _bounds(min, max)
        # Floats are refused even when whole: a count written as 1e30 is a corrupt file.
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise self.fail(key, form, value)
        value = int(value)
        if (min is not None and value < min) or (max is not None and value > max):
            raise self.fail(key, form, value)
        return value

    def number(self, key: str, default: Any = MISSING, *, min: float | None = None, max: float | None = None,
               above: float | None = None) -> Any:
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return value
        form = "a finite number" + (f" above {above:g}" + (f" and at most {max:g}" if max is not None else "")
                                    if above is not None else _bounds(min, max))
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise self.fail(key, form, value)
        value = float(value)
        if not math.isfinite(value) or (min is not None and value < min) or (max is not None and value > max) \
                or (above is not None and value <= above):
            raise self.fail(key, form, value)
        return value

    def boolean(self, key: str, default: Any = MISSING) -> Any:
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return value
        if not isinstance(value, (bool, np.bool_)):
            raise self.fail(key, "true or false", value)
        return bool(value)

    def string(self, key: str, default: Any = MISSING, *, max_chars: int | None = None) -> Any:
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return value
        form = "a string" + (f" of at most {max_chars:,} characters" if max_chars else "")
        if not isinstance(value, str) or (max_chars is not None and len(value) > max_chars):
            raise self.fail(key, form, value)
        return value

    def mapping(self, key: str, default: Any = MISSING) -> Any:
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return value
        if not isinstance(value, dict):
            raise self.fail(key, "an object (a JSON mapping of names to values)", value)
        return value

    def integers(self, key: str, default: Any = MISSING, *, min: int | None = None, max: int | None = None,
                 single: bool = False) -> Any:
        """A list of integers (``single``: one integer is accepted as a list of one)."""
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return value
        bounds = _bounds(min, max)
        form = f"an integer{bounds} or a list of them" if single else f"a list of integers{bounds}"
        if single and not isinstance(value, (list, tuple)):
            return [self.check_int(key, value, min=min, max=max, form=form)]
        if not isinstance(value, (list, tuple)):
            raise self.fail(key, form, value)
        if value and all(type(v) is int for v in value) and (min is None or builtins.min(value) >= min) \
                and (max is None or builtins.max(value) <= max):
            return list(value)  # a vocabulary's token types: the common case without a call per item
        return [self.check_int(key, v, min=min, max=max, form=form) for v in value]

    def numbers(self, key: str, default: Any = MISSING) -> Any:
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return value
        ok = isinstance(value, (list, tuple)) and all(
            isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)
            for v in value)
        if not ok:
            raise self.fail(key, "a list of finite numbers", value)
        return [float(v) for v in value]

    def strings(self, key: str, default: Any = MISSING, *, max_chars: int | None = None) -> Any:
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return value
        form = "a list of strings" + (f" of at most {max_chars:,} characters each" if max_chars else "")
        if not isinstance(value, (list, tuple)):
            raise self.fail(key, form, value)
        # a vocabulary's 50-250 thousand entries: the common case checked in C loops first
        if all(type(v) is str for v in value) and (max_chars is None or max(map(len, value), default=0) <= max_chars):
            return list(value)
        for i, v in enumerate(value):
            if not isinstance(v, str):
                raise self.fail(key, form, value if len(value) <= 8 else f"<item {i}: {_kind(v)}>")
            if max_chars is not None and len(v) > max_chars:
                raise self.fail(key, form, f"<item {i}: {len(v):,} characters>")
        return list(value)


def _bounds(min: Any = None, max: Any = None) -> str:
    """" from 1 to 8", " of at least 1", ... (empty without bounds)."""
    def fmt(v: Any) -> str:
        return f"{v:,}" if isinstance(v, int) else f"{v:g}"

    if min is not None and max is not None:
        return f" from {fmt(min)} to {fmt(max)}"
    if min is not None:
        return f" of at least {fmt(min)}"
    if max is not None:
        return f" of at most {fmt(max)}"
    return ""


def contained_file(folder: Path, name: Any, *, listing: Path, key: str) -> Path:
    """``folder / name`` for a file name taken from ``listing`` (e.g. a shard index),
    refusing anything that is not a plain relative path inside ``folder``: absolute
    paths, ``..`` components, empty names, the folder itself, NUL bytes.

    The check is on the name, not on where symlinks lead: a folder's own symlinks (the
    Hugging Face cache links every file to a blob outside its snapshot folder) are the
    folder owner's, while a name in the metadata is the file author's.
    """
    if not isinstance(name, str):
        raise WeightsError(f"{key} must map to a string file name, got {_kind(name)} {shown(name)}", file=listing)
    parts = PurePosixPath(name).parts
    if not name or "\0" in name or not parts or name.endswith("/") or parts[-1] in (".", ".."):
        raise WeightsError(f"{key} names {shown(name)}, which is not a file name", file=listing)
    if PurePosixPath(name).is_absolute() or ".." in parts:
        raise WeightsError(
            f"{key} names {shown(name)}, a path outside the model folder {str(folder)!r}; only files inside "
            f"the folder are read (the file is corrupt or hostile)",
            file=listing,
        )
    return folder / name


def require_finite(arr: np.ndarray, *, file: Any, tensor: str) -> np.ndarray:
    """``arr`` if every value is finite; else WeightsError naming the tensor and the first bad value."""
    finite = np.isfinite(arr)
    if not finite.all():
        flat = int(np.argmin(finite.reshape(-1)))
        index = tuple(int(i) for i in np.unravel_index(flat, arr.shape))
        bad = arr.reshape(-1)[flat]
        kind = "NaN" if np.isnan(bad) else "infinite"
        raise WeightsError(
            f"holds {kind} values ({int(finite.size - finite.sum()):,} of {finite.size:,}, the first at {index}); "
            f"the file is corrupt, or was saved from a model that diverged",
            file=file, tensor=tensor,
        )
    return arr
