"""Registry mode: the suite on the backend named by ``--polyengine-backend``.

Collected by the plugin when ``pytest --pyargs polyengine.conformance`` (or
``polyengine conformance``) asks for a backend. The backend comes from the plugin
registry, its factory from ``BackendInfo.load_factory()``, and its tolerance overrides
and xfail file from the names in its ``BackendSpec``.
"""

from __future__ import annotations

import pytest

from polyengine.conformance.pytest_plugin import registered_backend
from polyengine.conformance.suite import BackendConformance


class TestRegisteredBackend(BackendConformance):
    stop_when_unavailable = True  # the run is this backend's alone (Harness.default_engine)

    @pytest.fixture
    def engine_factory(self, request):
        return registered_backend(request.config).load_factory()

    @pytest.fixture
    def conformance_tolerances(self, request):
        return registered_backend(request.config).spec.tolerances

    @pytest.fixture
    def conformance_xfail(self, request):
        return registered_backend(request.config).spec.xfail

    @pytest.fixture
    def conformance_metadata(self, request):
        info = registered_backend(request.config)
        return {"name": info.name, "distribution": info.distribution, "version": info.version, "plugin": info.plugin}
