"""SamplingParams: what one request asks of the sampler and of the stop logic.

The parameters belong to the request: they travel in the Prefix and ``insert`` installs
them in the slot, so every slot samples with its own. The semantics (order of the
steps, penalty definitions, the random stream) are in ``polyengine.sampling.sampler``
and docs/design.md.

Every field has a neutral default; ``active_fields()`` names the ones a request
changed, which is what a backend checks against its declared capabilities before
doing any work.
"""

from __future__ import annotations

import re
import reprlib
import secrets
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from polyengine.errors import InvalidRequest
from polyengine.limits import (
    MAX_LOGIT_BIAS, MAX_SCHEMA_DEPTH, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, json_depth,
)

__all__ = ["SamplingParams", "StructuredOutput", "MAX_SAMPLES", "MAX_STEPS", "MAX_TOP_LOGPROBS", "ENGINE_FIELDS"]

# The counter's second word is ``step + 2**20 * sample_index`` (32 bits), which bounds both.
MAX_STEPS = 1 << 20
MAX_SAMPLES = 1 << 12
MAX_TOP_LOGPROBS = 20

# Fields a backend's sampler implements (declared in Capabilities.sampling_params).
ENGINE_FIELDS = frozenset(
    {
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "min_tokens",
        "ignore_eos",
        "logprobs",
        "top_logprobs",
        "seed",
    }
)
# The other fields (n, max_tokens, stop, stop_token_ids, structured) are the driver's:
# stop logic, fan-out over bulk_insert and grammars (as token masks), on top of any backend.


def is_int(value: object) -> bool:
    """An integer (Python or NumPy), not a bool: what token ids, counts and slots must be."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value: object) -> bool:
    """A real number (Python or NumPy), not a bool nor a string."""
    return is_int(value) or isinstance(value, (float, np.floating))


class StructuredOutput(BaseModel):
    """A constraint on the completion's text, enforced by the driver's grammar engine
    (``pip install 'polyengine[structured]'``) through per-step allowed-token masks.

    Exactly one of: ``json_schema`` (a JSON Schema object: the completion is one JSON
    value valid under it), ``json_object`` (any JSON object), ``regex``, ``grammar`` (a
    Lark grammar in llguidance's dialect, which may embed ``%json {schema}``), ``choice``
    (one of these strings). The completion ends when the constraint is complete
    (``finish_reason`` "stop") or earlier by the other stop conditions.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise InvalidRequest(_describe(exc), field="structured") from None

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutput":
        set_ = [n for n in ("json_schema", "regex", "grammar", "choice") if getattr(self, n) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise ValueError(f"structured needs exactly one of json_schema, json_object, regex, grammar, choice; got "
                             f"{', '.join(set_) or 'none'}")
        if self.choice is not None and not self.choice:
            raise ValueError("choice needs at least one string")
        if self.json_schema is not None and json_depth(self.json_schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
            # before anything recursive (json.dumps, llguidance) walks it
            raise ValueError(f"json_schema nests more than {MAX_SCHEMA_DEPTH} levels of objects and arrays; flatten it")
        return self


class SamplingParams(BaseModel):
    """Per-request sampling and stopping parameters (immutable; unknown fields refused).

    ``max_tokens=None`` means "until a stop condition or the engine's cache is full".
    ``top_k=0`` disables top-k; ``top_p=1`` and ``min_p=0`` disable those filters.
    ``seed=None`` gets a random 64-bit seed when the request is admitted; the seed used
    is reported back so the output can be reproduced.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    n: int = Field(1, ge=1, le=MAX_SAMPLES, description="samples per prompt")
    max_tokens: int | None = Field(None, ge=1, description="completion tokens at most")
    min_tokens: int = Field(0, ge=0, description="EOS and stop tokens are masked until this many tokens")
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0, description="0 disables")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] = Field(default_factory=dict)
    seed: int | None = Field(None, ge=0, lt=1 << 64)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    # the driver's: a grammar the completion must follow (allowed-token masks per step)
    structured: StructuredOutput | None = None

    @field_validator("n", "max_tokens", "min_tokens", "top_k", "seed", "top_logprobs", mode="before")
    @classmethod
    def _integer(cls, v: Any) -> Any:
        # pydantic's lax mode would read "3", 3.0 and True as 3, 3 and 1
        if v is not None and not is_int(v):
            raise ValueError(f"must be an integer, not {type(v).__name__}")
        return v

    @field_validator("ignore_eos", "logprobs", mode="before")
    @classmethod
    def _boolean(cls, v: Any) -> Any:
        if not isinstance(v, (bool, np.bool_)):  # "yes", "off" and 1 are not booleans
            raise ValueError(f"must be true or false, not {type(v).__name__}")
        return bool(v)

    @field_validator("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                     mode="before")
    @classmethod
    def _real(cls, v: Any) -> Any:
        if not is_number(v):
            raise ValueError(f"must be a number, not {type(v).__name__}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_tuple(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = (v,)
        v = tuple(v) if isinstance(v, list) else v
        # Counted before the items are validated: a huge list costs nothing to refuse.
        if isinstance(v, tuple) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(v)}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        longest = max(map(len, v), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got one of {longest}")
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        # A lone surrogate (undecodable input bytes) can never appear in decoded text:
        # such a stop string would be silently ignored.
        if any("\ud800" <= c <= "\udfff" for s in v for c in s):
            raise ValueError("stop strings must be valid Unicode (a lone surrogate cannot match model text)")
        return v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _ids_as_tuple(cls, v: Any) -> Any:
        v = tuple(v) if isinstance(v, list) else v
        if isinstance(v, tuple) and len(v) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(v)}")
        if isinstance(v, tuple) and not all(is_int(t) for t in v):
            raise ValueError("stop token ids must be integers")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_count(cls, v: Any) -> Any:
        if isinstance(v, dict) and len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(v)}")
        if isinstance(v, dict) and not all(is_number(b) for b in v.values()):
            raise ValueError("logit_bias values must be numbers")  # keys may be strings: JSON's are
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _ids_nonneg(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[int, float]) -> dict[int, float]:
        for tok, b in v.items():
            if tok < 0:
                raise ValueError(f"token id {tok} must be >= 0")
            if not -100.0 <= b <= 100.0 or b != b:
                raise ValueError(f"bias {b} for token {tok} must be in [-100, 100]")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "SamplingParams":
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs > 0 needs logprobs=True")
        return self

    # -- construction with polyengine's error type ------------------------------------

    def __init__(self, **data: Any) -> None:
        """Validate; a bad value raises :class:`InvalidRequest` naming field and range."""
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise InvalidRequest(_describe(exc), field=_first_field(exc)) from None

    @classmethod
    def create(cls, **kwargs: Any) -> "SamplingParams":
        """Build and validate (the same as the constructor; kept for symmetry with ``coerce``)."""
        return cls(**kwargs)

    @classmethod
    def coerce(cls, value: "SamplingParams | dict[str, Any] | None") -> "SamplingParams":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls.create(**value)
        raise InvalidRequest(
            f"sampling must be SamplingParams, a dict or None, not {type(value).__name__}"
        )

    def replace(self, **changes: Any) -> "SamplingParams":
        """A validated copy with some fields changed."""
        return type(self).create(**{**self.model_dump(), **changes})

    # -- what the request uses ----------------------------------------------------------

    def active_fields(self) -> frozenset[str]:
        """Names of fields set to something other than their neutral default."""
        return frozenset(
            name for name, info in type(self).model_fields.items()
            if name != "seed" and getattr(self, name) != info.get_default(call_default_factory=True)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self) -> "SamplingParams":
        """This request with a concrete seed: its own, or a fresh random 64-bit one."""
        if self.seed is not None:
            return self
        return self.model_copy(update={"seed": secrets.randbits(64)})


_BOUND_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})


def _allowed_range(name: str) -> str | None:
    """The field's numeric range in interval notation, e.g. ``(0, 1]`` for top_p."""
    info = SamplingParams.model_fields.get(name)
    if info is None:
        return None
    lo, hi, lo_open, hi_open = None, None, False, False
    for m in info.metadata:
        if getattr(m, "ge", None) is not None:
            lo = m.ge
        elif getattr(m, "gt", None) is not None:
            lo, lo_open = m.gt, True
        if getattr(m, "le", None) is not None:
            hi = m.le
        elif getattr(m, "lt", None) is not None:
            hi, hi_open = m.lt, True
    if lo is None and hi is None:
        return None
    left = "(" if lo_open or lo is None else "["
    right = ")" if hi_open or hi is None else "]"
    return f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"


def _first_field(exc: ValidationError) -> str | None:
    """The field the first error is about; a cross-field check (empty location) is
    blamed on the first field its message names."""
    err = exc.errors()[0]
    if err["loc"]:
        return str(err["loc"][0])
    found = [(m.start(), name) for name in SamplingParams.model_fields
             for m in [re.search(rf"\b{name}\b", err["msg"])] if m]
    return min(found)[1] if found else None


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 120, 120


def _shown(value: Any, limit: int = 120) -> str:
    """A value for an error message, shortened without building its whole repr: a refused
    list may be huge, a refused schema nested thousands deep (plain repr would recurse)."""
    text = _SHORT.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "sampling"
        # Our own validators' messages already say what is wrong; pydantic's prefix
        # only adds noise.
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            known = ", ".join(SamplingParams.model_fields)
            msg = f"unknown field; known fields: {known}"
        elif "input" in err and err["type"] not in ("missing",) and err["loc"]:
            # A model-level error's input is the whole request, which would drown the message.
            msg = f"{msg} (got {_shown(err['input'])})"
        if err["type"] in _BOUND_ERRORS and err["loc"]:
            allowed = _allowed_range(str(err["loc"][0]))
            if allowed:
                msg = f"{msg}; allowed range {allowed}"
        parts.append(f"{loc}: {msg}")
    return "invalid sampling parameters: " + "; ".join(parts)
