"""The conformance suite: one set of tests every polyengine backend must pass.

Two ways in, one set of test bodies (see docs/conformance.md):

* from the plugin registry: ``polyengine conformance --backend NAME`` or
  ``pytest --pyargs polyengine.conformance --polyengine-backend NAME``;
* subclass mode, in a backend's own repository::

      from polyengine.conformance import BackendConformance

      class TestMyBackend(BackendConformance):
          @pytest.fixture
          def engine_factory(self):
              return mybackend.create_engine   # factory(model=Model, config=EngineConfig)

The tests come in layers, cheap to expensive, so the first failure explains the rest:
surface -> contract -> lifetime -> numerics -> sampler -> honesty -> differential.

This package is imported by the pytest plugin in every pytest run of an environment
that has polyengine installed, so importing it costs nothing: the suite itself loads
on first use of :class:`BackendConformance`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from polyengine.conformance.suite import BackendConformance

__all__ = ["SUITE_VERSION", "LAYERS", "BackendConformance", "layer"]

SUITE_VERSION = "1.0"
LAYERS = ("surface", "contract", "lifetime", "numerics", "sampler", "honesty", "differential")
# The attribute that marks a test function as part of the suite and names its layer;
# the pytest plugin reads it without importing the suite.
LAYER_ATTR = "_polyengine_layer"

_C = TypeVar("_C", bound=type)


def layer(name: str) -> Callable[[_C], _C]:
    """Class decorator: every ``test_*`` method of the class belongs to layer ``name``."""
    if name not in LAYERS:
        raise ValueError(f"unknown layer {name!r}; layers are {LAYERS}")

    def mark(cls: _C) -> _C:
        for attr, fn in vars(cls).items():
            if attr.startswith("test_") and callable(fn):
                setattr(fn, LAYER_ATTR, name)
        return cls

    return mark


def __getattr__(name: str) -> Any:
    if name == "BackendConformance":
        from polyengine.conformance.suite import BackendConformance

        return BackendConformance
    raise AttributeError(f"module 'polyengine.conformance' has no attribute {name!r}")
