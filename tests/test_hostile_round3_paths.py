"""Issue 38: no cache or key folder is relative to the working directory.

A process with no ``$HOME`` and no passwd entry (some containers) used to resolve the
kernel cache, the signing key's folder and the neuron cache to ``./~/.cache/...`` of
whatever directory it ran in (or raise pathlib's untyped RuntimeError). Now every one
is absolute: a private folder under the temporary directory, checked before use, or an
UnsafeCache naming ``POLYENGINE_CACHE``. A damaged sidecar is a reason to rebuild, never
an exception.
"""

from __future__ import annotations

import json
import os
import pwd
import stat
import tempfile
import warnings

import pytest

from polyengine import cache
from polyengine.backends.neuron.cache import default_cache_dir
from polyengine.errors import UnsafeCache


@pytest.fixture
def homeless(tmp_path, monkeypatch):
    """No HOME, no passwd entry, no XDG or polyengine variables; the working directory
    and the system temporary directory are the test's own."""
    for name in ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "POLYENGINE_CACHE", "POLYENGINE_NEURON_CACHE"):
        monkeypatch.delenv(name, raising=False)

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir(mode=0o1777)
    os.chmod(tmp, 0o1777)  # like /tmp: shared, sticky
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    assert os.path.expanduser("~") == "~"  # the situation of the issue
    return work, tmp


def test_without_a_home_every_folder_is_private_under_the_temporary_directory(homeless):
    work, tmp = homeless
    own = tmp / f"polyengine-{os.geteuid()}"
    kernels = cache.private_dir(cache.cache_root() / "kernels", what="CPU kernel cache")  # as the kernel cache does
    assert kernels == own / "cache" / "kernels" and default_cache_dir() == own / "cache" / "neuron"
    assert cache.config_root() == own / "config"
    assert stat.S_IMODE(os.stat(own).st_mode) == 0o700
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the key is written, not replaced by a per-process one
        key = cache.user_key()
    assert (own / "config" / "cache-key").read_bytes() == key
    assert list(work.iterdir()) == []  # nothing in the working directory


def test_a_temporary_folder_someone_else_could_write_is_refused_naming_the_variable(homeless):
    _, tmp = homeless
    planted = tmp / f"polyengine-{os.geteuid()}"
    planted.mkdir()
    os.chmod(planted, 0o777)
    with pytest.raises(UnsafeCache, match="no home directory.*set POLYENGINE_CACHE"):
        cache.cache_root()


@pytest.mark.parametrize("name, root", [("POLYENGINE_CACHE", cache.cache_root),
                                        ("POLYENGINE_NEURON_CACHE", default_cache_dir)])
def test_a_relative_cache_variable_is_refused(monkeypatch, name, root):
    monkeypatch.setenv(name, "cache/here")
    with pytest.raises(UnsafeCache, match=f"\\${name} is 'cache/here', a relative path"):
        root()


def test_a_relative_xdg_variable_is_ignored(monkeypatch, tmp_path):
    monkeypatch.delenv("POLYENGINE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative")
    assert cache.cache_root() == tmp_path / ".cache" / "polyengine"
    assert cache.config_root() == tmp_path / ".config" / "polyengine"


@pytest.mark.parametrize("record", ['{"size": 1e999, "sha256": "0", "signature": "0"}',
                                    '{"size": "x", "sha256": "0", "signature": "0"}', "[1, 2]", "[" * 100_000])
def test_a_damaged_sidecar_is_a_reason_to_rebuild(tmp_path, monkeypatch, record):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    folder = cache.private_dir(tmp_path / "c")
    cache.store(folder / "entry.so", lambda p: p.write_bytes(b"code"))
    (folder / "entry.so.json").write_text(record)
    assert cache.check(folder / "entry.so") == (None, "entry.so.json is not a valid sidecar")


def test_a_relative_neuron_cache_option_is_refused():
    pytest.importorskip("torch")
    from polyengine.backends.neuron.engine import NeuronEngine
    from polyengine.errors import InvalidRequest
    from polyengine.options import check_options

    with pytest.raises(InvalidRequest, match="cache_dir.*must be an absolute path"):
        check_options(NeuronEngine.OPTIONS, {"cache_dir": "graphs"}, backend="neuron")
    assert check_options(NeuronEngine.OPTIONS, {"cache_dir": "/abs/graphs"}, backend="neuron")["cache_dir"] == "/abs/graphs"
