"""The engine protocol and the backend kit, in one import.

``polyengine.engine`` re-exports the modules that hold them, split by concern:
:mod:`polyengine.protocol` (the protocol's types and its one declaration),
:mod:`polyengine.results` (what a call returns), :mod:`polyengine.validation` (request
checks shared by the driver and the engines) and :mod:`polyengine.kit` (``EngineBase``
and the pieces a backend builds on). The contracts are written out in
``docs/design.md``.
"""

from __future__ import annotations

from polyengine.kit import EngineBase
from polyengine.options import Option, check_options
from polyengine.protocol import (
    DEFAULT_CONTEXT_LENGTH,
    OPTIONAL_METHODS,
    CAPABILITY_KEYWORDS,
    PROTOCOL_VERSION,
    Capabilities,
    DecodeState,
    Engine,
    EngineConfig,
    Override,
    Prefix,
    PrefillRequest,
    power_buckets,
    protocol_members,
    protocol_problems,
)
from polyengine.results import ResultLayout, ResultTokens
from polyengine.slots import Slot, SlotTable
from polyengine.validation import check_prompt, check_request, is_int

__all__ = [
    "PROTOCOL_VERSION",
    "Capabilities",
    "EngineConfig",
    "DEFAULT_CONTEXT_LENGTH",
    "Prefix",
    "PrefillRequest",
    "DecodeState",
    "Override",
    "ResultLayout",
    "ResultTokens",
    "Engine",
    "EngineBase",
    "Option",
    "check_options",
    "Slot",
    "SlotTable",
    "OPTIONAL_METHODS",
    "CAPABILITY_KEYWORDS",
    "protocol_members",
    "protocol_problems",
    "check_prompt",
    "check_request",
    "is_int",
    "power_buckets",
]
