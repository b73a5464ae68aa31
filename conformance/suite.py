"""``BackendConformance``: the whole suite as one class to subclass, and its fixtures.

A backend's repository runs the suite by subclassing::

    import pytest
    from polyengine.conformance import BackendConformance

    class TestMyBackend(BackendConformance):
        @pytest.fixture
        def engine_factory(self):
            from mybackend import create_engine
            return create_engine        # create_engine(model=Model, config=EngineConfig) -> Engine

        @pytest.fixture                  # optional: [[override]] entries, each with a reason
        def conformance_tolerances(self):
            return "mybackend:conformance.toml"

        @pytest.fixture                  # optional: strict known failures, each with a reason
        def conformance_xfail(self):
            return "mybackend:xfail.toml"

Fixtures: ``engine_factory`` (required; a missing one fails collection, naming it);
``conformance_tolerances`` and ``conformance_xfail`` (optional: a ``"package:resource"``
name, a path, a dict, or None); ``conformance_metadata`` (optional: a dict with
``name``, ``distribution``, ``version`` for the report, else read from the engine).

The factory is asked for engines with the suite's own limits and models; each engine
is built once per test class, however the fixtures are scoped.
"""

from __future__ import annotations

import itertools

import pytest

from polyengine.conformance import LAYER_ATTR
from polyengine.conformance.harness import Context, Harness
from polyengine.conformance.layer_contract import ContractLayer
from polyengine.conformance.layer_differential import DifferentialLayer
from polyengine.conformance.layer_edges import EdgeLayer
from polyengine.conformance.layer_honesty import HonestyLayer
from polyengine.conformance.layer_lifetime import LifetimeLayer
from polyengine.conformance.layer_numerics import NumericsLayer
from polyengine.conformance.layer_prefixes import PrefixLayer
from polyengine.conformance.layer_sampler import SamplerLayer
from polyengine.conformance.layer_surface import SurfaceLayer

__all__ = ["BackendConformance", "REQUIRED_FIXTURES", "suite_test_names", "suite_test_ids"]

REQUIRED_FIXTURES = ("engine_factory",)


class BackendConformance(SurfaceLayer, ContractLayer, PrefixLayer, LifetimeLayer, NumericsLayer, EdgeLayer, SamplerLayer, HonestyLayer,
                         DifferentialLayer):
    """Every conformance test, in layers (surface, contract, lifetime, numerics, sampler, honesty,
    differential).

    Not collected itself (its name does not start with ``Test``); subclass it.
    """

    @pytest.fixture
    def conformance_tolerances(self):
        return None

    @pytest.fixture
    def conformance_xfail(self):
        return None

    @pytest.fixture
    def conformance_metadata(self):
        return None

    @pytest.fixture(autouse=True)
    def conformance(self, request, engine_factory, conformance_tolerances, conformance_xfail, conformance_metadata) -> Context:
        """The test's view of the backend under test (its engines, the oracle, the tolerances)."""
        from polyengine.conformance.pytest_plugin import suite_state

        state = suite_state(request.config)
        cls_node = request.node.getparent(pytest.Class)
        key = cls_node.nodeid
        if key not in state.harnesses:
            try:
                state.harnesses[key] = Harness(
                    engine_factory,
                    tolerances=conformance_tolerances,
                    xfail=conformance_xfail,
                    metadata=conformance_metadata,
                    test_names=suite_test_names(),
                    test_ids=suite_test_ids(),
                    options=run_options(request.config),
                    stop_when_unavailable=getattr(request.cls, "stop_when_unavailable", False),
                )
            except Exception as exc:  # every test of the class reports the same config error
                state.harnesses[key] = exc
        harness = state.harnesses[key]
        if isinstance(harness, Exception):
            raise harness
        ctx = Context(harness, request.node.originalname, request.node.name)
        reason = harness.xfail.reason_for(ctx.test_id)
        if reason:
            request.applymarker(pytest.mark.xfail(reason=f"{reason} ({harness.xfail.origin})", strict=True))
        request.node.user_properties.append(("polyengine", ctx.record))
        return ctx


def run_options(config: pytest.Config) -> dict:
    """The engine options of this run (``--polyengine-option KEY=VALUE``, repeatable)."""
    from polyengine.conformance.tolerances import parse_option

    return dict(parse_option(text) for text in config.getoption("polyengine_option", None) or ())


def suite_test_names() -> list[str]:
    """The names of every test function of the suite (what tolerance overrides may name)."""
    return sorted(n for n in dir(BackendConformance) if n.startswith("test_") and hasattr(getattr(BackendConformance, n), LAYER_ATTR))


def suite_test_ids() -> list[str]:
    """Every test id of the suite (``name[params]``), whatever this run collected: the
    xfail file is checked against these, so running a subset never makes it stale."""
    ids = []
    for name in suite_test_names():
        # pytestmark lists the decorators nearest the function first, which is also
        # the order of the parts of pytest's ids.
        marks = [m for m in getattr(getattr(BackendConformance, name), "pytestmark", []) if m.name == "parametrize"]
        if not marks:
            ids.append(name)
            continue
        for combo in itertools.product(*([str(v) for v in m.args[1]] for m in marks)):
            ids.append(f"{name}[{'-'.join(combo)}]")
    return ids
