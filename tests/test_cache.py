"""``polyengine.cache``: private directories and signed entries for cached code.

"Another user" is simulated as root can: directories and files made writable by group
or others, or handed to another uid with ``chown`` (those cases skip when the tests do
not run as root), and a cache signed with another user's key (another config folder).
"""

from __future__ import annotations

import os
import pickle
import stat
import warnings

import pytest

from polyengine.cache import check, private_dir, store, user_key
from polyengine.errors import UnsafeCache

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
OTHER_UID = 54321


@pytest.fixture(autouse=True)
def _own_key(tmp_path, monkeypatch):
    """A key folder of the test's own (the user's real one is never touched)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_missing_levels_are_created_private(tmp_path):
    old = os.umask(0o002)  # a permissive umask must not leak into the cache
    try:
        d = private_dir(tmp_path / "a" / "b" / "c")
    finally:
        os.umask(old)
    assert d.is_dir()
    assert [_mode(tmp_path / p) for p in ("a", "a/b", "a/b/c")] == [0o700] * 3


@pytest.mark.parametrize("mode, who", [(0o770, "group"), (0o707, "others"), (0o777, "group and others")])
def test_a_directory_others_can_write_is_refused_with_the_fix(tmp_path, mode, who):
    d = tmp_path / "cache"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(UnsafeCache, match=f"writable by {who}.*fix: chmod 700 {d}"):
        private_dir(d)


def test_a_writable_directory_above_is_refused_unless_sticky(tmp_path):
    above = tmp_path / "shared"
    (above / "mine").mkdir(parents=True)
    os.chmod(above / "mine", 0o700)
    os.chmod(above, 0o777)
    with pytest.raises(UnsafeCache, match=f"{above} is writable by group and others.*fix: set POLYENGINE_CACHE"):
        private_dir(above / "mine")
    os.chmod(above, 0o1777)  # like /tmp: others cannot rename what is ours
    assert private_dir(above / "mine") == above / "mine"


@as_root
def test_a_directory_another_user_owns_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, OTHER_UID, -1)
    with pytest.raises(UnsafeCache, match=f"owned by uid {OTHER_UID}"):
        private_dir(d)


def _entry(tmp_path, data: bytes = b"\x7fELF compiled code"):
    d = private_dir(tmp_path / "cache")
    path = d / "entry.so"
    record = store(path, lambda tmp: tmp.write_bytes(data), {"what": "test"})
    return path, record


def test_a_stored_entry_checks_out_with_its_record(tmp_path):
    path, record = _entry(tmp_path)
    got, reason = check(path)
    assert reason == "ok" and got == record and got["what"] == "test"
    assert got["size"] == path.stat().st_size and len(got["sha256"]) == 64
    assert _mode(path) == 0o600 and _mode(path.with_name("entry.so.json")) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["entry.so", "entry.so.json"]  # no temporaries left


def test_a_missing_entry_is_missing(tmp_path):
    assert check(private_dir(tmp_path / "c") / "none.so") == (None, "missing")


@pytest.mark.parametrize("damage, reason", [
    (lambda p: p.write_bytes(p.read_bytes()[:5]), "has 5 bytes"),  # truncated
    (lambda p: p.write_bytes(b""), "has 0 bytes"),  # empty
    (lambda p: p.write_bytes(p.read_bytes()[::-1]), "SHA-256 differs"),  # same size, other bytes
    (lambda p: p.with_name(p.name + ".json").unlink(), "no signed record"),
    (lambda p: p.with_name(p.name + ".json").write_text("{not json"), "not a valid sidecar"),
    (lambda p: os.chmod(p, 0o666), "writable by group or others"),
])
def test_a_damaged_entry_is_never_accepted(tmp_path, damage, reason):
    path, _ = _entry(tmp_path)
    damage(path)
    record, why = check(path)
    assert record is None and reason in why


def test_a_planted_pickle_with_a_forged_record_is_refused(tmp_path):
    """Whoever writes the file can compute its size and digest, but not the signature."""
    import hashlib
    import json

    path, record = _entry(tmp_path)
    payload = pickle.dumps(os.system)  # what an attacker would plant
    path.write_bytes(payload)
    forged = {**record, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    path.with_name(path.name + ".json").write_text(json.dumps(forged))
    got, why = check(path)
    assert got is None and "signature is not this user's" in why


def test_a_cache_signed_by_another_user_is_refused(tmp_path, monkeypatch):
    path, _ = _entry(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "someone-else"))  # another key
    got, why = check(path)
    assert got is None and "signature is not this user's" in why


@as_root
def test_an_entry_another_user_owns_is_refused(tmp_path):
    path, _ = _entry(tmp_path)
    os.chown(path, OTHER_UID, -1)
    got, why = check(path)
    assert got is None and f"owned by uid {OTHER_UID}" in why


def test_the_key_is_private_and_stable(tmp_path):
    key = user_key()
    path = tmp_path / "config" / "polyengine" / "cache-key"
    assert len(key) == 32 and path.read_bytes() == key and user_key() == key
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700


def test_processes_making_the_key_at_once_all_read_the_same_whole_key(tmp_path):
    """Test workers (pytest -n 2) or servers starting cold at the same moment: each gets the
    one key on disk, with no warning, never a half-written file."""
    import subprocess
    import sys

    code = ("import warnings; warnings.simplefilter('error'); "
            "from polyengine.cache import user_key; print(user_key().hex())")
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(6)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    keys = {out.strip() for out, _ in outs}
    path = tmp_path / "config" / "polyengine" / "cache-key"
    assert keys == {path.read_bytes().hex()}
    assert [p.name for p in path.parent.iterdir()] == ["cache-key"]  # no temporary file left


def test_a_key_others_can_read_is_not_used(tmp_path):
    user_key()
    path = tmp_path / "config" / "polyengine" / "cache-key"
    os.chmod(path, 0o644)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        key = user_key()
    assert key != path.read_bytes()  # a key for this process only, with a warning naming the fix
    assert any("mode 0600" in str(w.message) and "delete it" in str(w.message) for w in caught)
