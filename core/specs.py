"""What a backend plugin registers: a :class:`BackendSpec`, and its probe's answer, a
:class:`Probe`.

Both are plain data; nothing here imports a plugin or runs a probe (that is
:mod:`polyengine.discovery`). A spec carries everything the core needs to know about a
backend without importing it: how to check that it can run here (``probe``), how to
build an engine (``factory``, resolved lazily), how to install what it needs
(``extra``/``install_hint``), and where it ranks for ``backend="auto"``
(``priority``, ``accelerator``, ``accelerator_priority``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from polyengine._version import PROTOCOL_VERSION

__all__ = ["Probe", "BackendSpec", "NAME_PATTERN"]

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]{0,39}$")


@dataclass(frozen=True)
class Probe:
    """A backend's answer to "can you run here?".

    ``available``: its dependencies import and it can build an engine here.
    ``accelerator``: the hardware it targets is present (False for CPU paths).
    ``reason``: why it is unavailable, or what it found and will use (shown to users).
    ``by_name_only``: it can run here, but only when asked for by name; ``backend="auto"``
    never picks it (a development path, e.g. compiling an accelerator's graphs for the CPU).
    """

    available: bool
    accelerator: bool = False
    reason: str = ""
    by_name_only: bool = False


@dataclass(frozen=True)
class BackendSpec:
    """What a plugin registers for one backend.

    ``factory`` is a callable or a ``"module:attribute"`` string resolved on first use;
    it is called as ``factory(model=Model, config=EngineConfig)`` and returns an Engine.
    ``probe`` must import nothing heavy (``importlib.util.find_spec`` is the tool).

    Install hints: ``install_hint`` is shown verbatim when the backend cannot run here;
    without one, ``extra`` (the pip extra of the backend's distribution) gives
    ``pip install '<distribution>[<extra>]'``.

    Ranking for ``backend="auto"``: backends whose probe reports their accelerator
    present come first, highest ``accelerator_priority`` first; then every other
    available backend (CPU paths), highest ``priority`` first; ties by name.
    ``accelerator`` names the hardware kind (``"tpu"``, ``"neuron"``, ``"cuda"``, ...)
    or is None for a CPU-only backend.

    ``tolerances`` and ``xfail`` are ``"package:resource"`` names of the backend's
    conformance tolerance overrides and expected-failure file.

    ``diagnose`` (optional) is a callable or ``"module:attribute"`` string, called only
    by ``polyengine backends --verbose``: ``diagnose() -> dict[str, str]`` says what an
    engine with the default options would run on this machine (device, ISA, kernel and
    int8 paths, and for any fallback its reason and fix). It may import the framework
    and take seconds (e.g. build kernels); the listing without ``--verbose`` never calls it.

    ``options`` (optional) is a ``"module:attribute"`` string naming the backend's option
    table (what its engines' ``OPTIONS`` holds) in a module that imports no framework:
    ``polyengine backends --verbose`` lists it, and another backend's refusal of an
    unknown option names the backend that has it.

    ``weight_formats`` (optional) is a ``"module:attribute"`` string naming, in a module
    that imports no framework, the weight formats the backend's engines compute on as
    stored (what their ``Capabilities.weight_formats`` declare: names of
    ``polyengine.models.blocks.FORMATS``); ``polyengine backends --verbose`` says from it
    which formats the backend computes on and which the loader converts for it.
    """

    name: str
    description: str
    protocol_version: str
    probe: Callable[[], Probe]
    factory: Callable[..., Any] | str
    extra: str | None = None
    install_hint: str | None = None
    priority: int = 0
    accelerator: str | None = None
    accelerator_priority: int = 0
    tolerances: str | None = None
    xfail: str | None = None
    diagnose: Callable[[], dict[str, str]] | str | None = None
    options: str | None = None
    weight_formats: str | None = None

    def problems(self) -> list[str]:
        """What is malformed about this spec (empty when it is fine)."""
        out = []
        if not isinstance(self.name, str) or not NAME_PATTERN.match(self.name):
            out.append(f"name {self.name!r} must match {NAME_PATTERN.pattern}")
        if not isinstance(self.description, str) or not self.description.strip() or "\n" in self.description:
            out.append("description must be one non-empty line")
        major = str(self.protocol_version).split(".")[0]
        if major != PROTOCOL_VERSION.split(".")[0]:
            out.append(
                f"implements protocol {self.protocol_version!r} but this polyengine speaks "
                f"{PROTOCOL_VERSION!r} (major versions must match)"
            )
        if not callable(self.probe):
            out.append("probe must be callable")
        if isinstance(self.factory, str):
            if ":" not in self.factory:
                out.append(f"factory {self.factory!r} must look like 'package.module:attribute'")
        elif not callable(self.factory):
            out.append("factory must be callable or a 'module:attribute' string")
        if isinstance(self.diagnose, str):
            if ":" not in self.diagnose:
                out.append(f"diagnose {self.diagnose!r} must look like 'package.module:attribute'")
        elif self.diagnose is not None and not callable(self.diagnose):
            out.append("diagnose must be callable, a 'module:attribute' string or None")
        for attr in ("priority", "accelerator_priority"):
            val = getattr(self, attr)
            if not isinstance(val, int) or isinstance(val, bool):
                out.append(f"{attr} must be an int")
        for attr in ("options", "weight_formats"):
            val = getattr(self, attr)
            if val is not None and (not isinstance(val, str) or ":" not in val):
                out.append(f"{attr} {val!r} must look like 'package.module:attribute'")
        for attr in ("extra", "install_hint", "accelerator", "tolerances", "xfail"):
            val = getattr(self, attr)
            if val is not None and not isinstance(val, str):
                out.append(f"{attr} must be a string or None")
        for attr in ("tolerances", "xfail"):
            val = getattr(self, attr)
            if isinstance(val, str) and ":" not in val:
                out.append(f"{attr} {val!r} must look like 'package:resource'")
        return out
