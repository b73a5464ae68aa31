"""Issue 38: one tenant cannot learn another's prompts through the prefix cache.

The attack: client A sends a prompt holding a secret; client B sends a guess that shares
its first tokens, then a probe that shares them too. Without partitions, B's guess is
cut where it parts from A's prompt and that cut is cached, so B's probe reports the
shared run as ``cached_tokens`` (and starts faster): B learns that A sent those tokens.
On an engine with ``prefix_truncate`` (the reference here) the guess itself is served
from A's entry, cut where the prompts part. With partitions (per API key by default, per
``cache_salt`` on request) B's guess reports 0, and its probe only the run it shares
with B's own guess. The same attack within one tenant still finds the cache (the control
that shows the test can fail). Tiny random model on the reference backend.
"""

from __future__ import annotations

import warnings

import httpx
import pytest

from live_server import LiveServer
from polyengine.driver import LLM
from polyengine.driver.prefix_cache import PrefixCache
from polyengine.errors import InvalidRequest
from polyengine.models import load_model

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
SECRET = [5 + i for i in range(48)]  # 48 tokens: the first 32 are what B guesses
GUESS = SECRET[:32] + [200 + i for i in range(8)]
PROBE = SECRET[:32] + [240 + i for i in range(8)]


@pytest.fixture(scope="module")
def tiny():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("random:tiny")


def _attack(send) -> tuple[int, int]:
    """A's secret, then B's guess and probe; their cached_tokens."""
    send("a", SECRET)
    return send("b", GUESS), send("b", PROBE)


# -- the cache and the driver alone ------------------------------------------------------------


def test_a_partition_sees_only_its_own_prompts():
    class P:
        def __init__(self, toks):
            self.prompt_tokens, self.nbytes = tuple(toks), 10

    cache = PrefixCache(1000)
    cache.insert(P(SECRET), partition="a")
    assert cache.lookup(GUESS, "b") == (None, 0) and cache.lookup(GUESS) == (None, 0)
    entry, matched = cache.lookup(SECRET + [1], "a")
    assert entry.length == 48 and matched == 48
    cache.clear()  # an emptied partition leaves no tree behind
    assert cache._roots == {}


@pytest.mark.parametrize("salts, leaks", [(("a", "b"), False), (("x", "x"), True), ((None, None), True)])
def test_cache_salt_partitions_the_python_api(tiny, salts, leaks):
    llm = LLM(tiny, backend="reference", tools=False, max_slots=2, max_prefill_length=64, max_cache_length=80)
    tenant = dict(zip("ab", salts))

    def send(who, ids):
        return llm.generate([ids], {"max_tokens": 1}, cache_salt=tenant[who])[0].usage.cached_tokens

    assert _attack(send) == (32 if leaks else 0, 32)  # the probe shares 32 tokens with B's own guess


def _guess_work(tiny, salts, secret_sent: bool) -> tuple[int, int]:
    """The prompt tokens the engine prefilled for B's guess, its first request (counted
    at the engine's ``prefill``, the work its time to first token is made of), and its
    cached_tokens."""
    llm = LLM(tiny, backend="reference", tools=False, max_slots=2, max_prefill_length=64, max_cache_length=80)
    fed: list[int] = []
    prefill = llm.engine.prefill

    def counted(**kw):
        fed.append(len(kw["tokens"]))
        return prefill(**kw)

    llm.engine.prefill = counted
    tenant = dict(zip("ab", salts))

    def send(who, ids):
        return llm.generate([ids], {"max_tokens": 1}, cache_salt=tenant[who])[0].usage.cached_tokens

    if secret_sent:
        send("a", SECRET)
    fed.clear()
    cached = send("b", GUESS)
    return sum(fed), cached


@pytest.mark.parametrize("salts, leaks", [(("a", "b"), False), (("x", "x"), True)])
def test_the_guess_does_the_same_work_whether_or_not_the_secret_was_sent(tiny, salts, leaks):
    """Timing across tenants, measured by its cause rather than the clock: B's guess runs
    the whole prompt through the engine whether or not A sent the secret, so nothing
    about A can show in its time to first token. In one partition (the control) A's
    secret saves the guess 32 of its 40 tokens (the 32 shared ones are cut from A's
    entry as a head, engine.prefix_head, with no forward): the difference the attack
    would time."""
    without = _guess_work(tiny, salts, secret_sent=False)
    with_secret = _guess_work(tiny, salts, secret_sent=True)
    assert without == (len(GUESS), 0)
    assert with_secret == ((len(GUESS) - 32, 32) if leaks else without)


def test_a_cache_salt_must_be_a_non_empty_string(tiny):
    llm = LLM(tiny, backend="reference", tools=False, max_slots=1, max_prefill_length=16, max_cache_length=24)
    for bad in ("", 5, "x" * 5000):
        with pytest.raises(InvalidRequest) as err:
            llm.generate([[1, 2, 3]], {"max_tokens": 1}, cache_salt=bad)
        assert err.value.field == "cache_salt"


# -- through the server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = LiveServer(["--model", "random:tiny", "--backend", "reference", "--max-slots", "2", "--context-length", "80",
                    "--api-key", KEY_A, "--api-key", KEY_B, "--idle-timeout", "60", "--header-timeout", "60"],
                   tmp_path_factory.mktemp("tenants") / "server.log")
    yield s
    assert s.stop() == 0, s.log()


def _client(server, keys: dict[str, str], salts: dict[str, str] | None = None):
    http = httpx.Client(timeout=60)

    def send(who, ids):
        body = {"model": "random:tiny", "prompt": ids, "max_tokens": 1}
        if salts and salts.get(who):
            body["cache_salt"] = salts[who]
        r = http.post(server.api + "/completions", json=body, headers={"Authorization": f"Bearer {keys[who]}"})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    return send


def _fresh(ids: list[int], n: int) -> list[int]:
    """The attack's prompts behind a first token no other case uses (the server's cache
    persists between cases); they still share 33 tokens, cut at 32."""
    return [260 + n, *ids]


@pytest.mark.parametrize("case, keys, salts, leaks", [
    (1, {"a": KEY_A, "b": KEY_B}, None, False),  # the attack of the issue: two keys
    (2, {"a": KEY_A, "b": KEY_A}, None, True),  # control: one tenant shares its cache with itself
    (3, {"a": KEY_A, "b": KEY_A}, {"a": "alice", "b": "bob"}, False),  # one key, end users apart by cache_salt
    (4, {"a": KEY_A, "b": KEY_B}, {"a": "same", "b": "same"}, False),  # a salt cannot reach another key's partition
])
def test_one_client_cannot_probe_another_clients_prompt(server, case, keys, salts, leaks):
    send = _client(server, keys, salts)
    secret = send("a", _fresh(SECRET, case))
    supplied = _hit_tokens(server)
    guess = send("b", _fresh(GUESS, case))
    # the engine's own count agrees: across tenants the cache supplied none of the guess's tokens, so all were prefilled
    assert _hit_tokens(server) - supplied == guess
    probe = (secret, guess, send("b", _fresh(PROBE, case)))
    assert probe == (0, 32 if leaks else 0, 32), probe  # the probe shares 32 tokens with B's own guess


def _hit_tokens(server) -> float:
    return server.metrics()[("polyengine_prefix_cache_hit_tokens_total",)]


def test_salt_mode_partitions_by_salt_alone():
    from polyengine.serving.app import _State
    from polyengine.serving.config import ServerConfig

    key_mode = _State(ServerConfig(api_keys=(KEY_A, KEY_B)), None)
    salt_mode = _State(ServerConfig(api_keys=(KEY_A, KEY_B), prefix_cache_partition="salt"), None)
    assert key_mode.partition("ta", None) != key_mode.partition("tb", None)
    assert key_mode.partition("ta", "s") != key_mode.partition("tb", "s")
    assert salt_mode.partition("ta", "s") == salt_mode.partition("tb", "s") != salt_mode.partition("ta", None)
    assert salt_mode.partition("ta", None) is None and key_mode.partition(None, None) is None


def test_api_keys_are_checked_when_the_server_starts():
    from polyengine.serving.config import ServerConfig, api_keys_from

    for bad in ("sk-x ", " sk-x", "sk x", "sk-\u00e9", ""):
        with pytest.raises(InvalidRequest) as err:
            ServerConfig(api_keys=(bad,))
        assert err.value.field == "api_key" and (not bad.strip() or bad.strip() not in str(err.value))
    assert api_keys_from(None, "k1,k2") == ("k1", "k2")
    with pytest.raises(InvalidRequest, match="whitespace at its end"):
        api_keys_from(["good", "bad "], None)
