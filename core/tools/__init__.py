"""Tools the model can call mid-generation (the calculator is built in).

:mod:`.calculator` is the safe arithmetic interpreter; :mod:`.machine` holds the
:class:`Tool` description, the plugin lookup and the per-row state machine the driver
runs.
"""

from polyengine.tools.calculator import evaluate
from polyengine.tools.machine import (
    CALCULATOR,
    MAX_EXPRESSION_TOKENS,
    Tool,
    ToolMachine,
    ToolRow,
    available_tools,
)

__all__ = [
    "Tool",
    "CALCULATOR",
    "available_tools",
    "evaluate",
    "ToolMachine",
    "ToolRow",
    "MAX_EXPRESSION_TOKENS",
]
