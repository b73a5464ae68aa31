"""``polyengine serve --replicas 2``: two engine replicas on a local Ray cluster behind
one loopback endpoint (slow: Ray starts in ~10 s; still runs in CI)."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile

import httpx
import openai
import psutil
import pytest

from live_server import LiveServer

pytestmark = pytest.mark.slow

MODEL = "random:tiny"


def _free_port() -> int:
    # Ray Serve's proxy needs a fixed port; the tiny window between closing this
    # socket and the proxy binding it is the price.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    # A short temp dir: Ray's socket paths must stay under the OS limit of ~107 bytes.
    ray_tmp = tempfile.mkdtemp(prefix="pe-ray-", dir="/tmp")
    log = tmp_path_factory.mktemp("ray") / "server.log"
    server = LiveServer(["--model", MODEL, "--backend", "reference", "--replicas", "2", "--max-slots", "2",
                         "--max-queue", "2", "--context-length", "128", "--shutdown-timeout", "5"],
                        log, env={"RAY_TMPDIR": ray_tmp}, port=_free_port(), start_timeout=120)
    try:
        yield server
    finally:
        code = server.stop(timeout=90)
        shutil.rmtree(ray_tmp, ignore_errors=True)
        assert code == 0, server.log()


def test_two_replicas_answer_behind_one_endpoint(replicas):
    client = openai.OpenAI(base_url=replicas.api, api_key="unused", max_retries=0, timeout=60)
    one = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=6, seed=5)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, seed=5, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == one.choices[0].message.content

    async def burst():
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=replicas.api, timeout=60, limits=limits) as http:
            body = {"model": MODEL, "prompt": "Once", "max_tokens": 24, "seed": 1}
            rs = await asyncio.wait_for(asyncio.gather(*(http.post("/completions", json=body) for _ in range(40))), 90)
        return rs

    # 40 at once against 2 replicas x (2 slots + 2 queue places): the queue stays bounded
    # behind Ray Serve too, so the excess gets 429 from a replica (OpenAI's body), not a
    # place in a queue without end in front of them.
    rs = asyncio.run(burst())
    assert all(r.status_code in (200, 429) for r in rs), {r.status_code for r in rs}
    assert sum(r.status_code == 200 for r in rs) >= 4
    refused = [r for r in rs if r.status_code == 429]
    assert refused and all(r.json()["error"]["code"] == "rate_limit_exceeded" for r in refused)
    texts = {r.json()["choices"][0]["text"] for r in rs if r.status_code == 200}
    assert len(texts) == 1  # both replicas load the same weights: same seed, same text
    # Ray Serve routes concurrent requests to the less loaded of two replicas.
    assert len({r.headers["x-polyengine-replica"] for r in rs}) == 2


def test_a_replica_whose_engine_died_fails_its_health_check():
    """Ray Serve calls check_health on each replica; it must fail for a dead engine."""
    from types import SimpleNamespace

    from polyengine.errors import EngineDead
    from polyengine.serving.replicas import Replica

    replica = Replica()
    engine = SimpleNamespace(dead=None)
    replica.app = SimpleNamespace(state=SimpleNamespace(polyengine=SimpleNamespace(engine=engine)))
    replica.check_health()  # alive: no error
    engine.dead = EngineDead("the engine thread stopped: SystemExit: 3")
    with pytest.raises(RuntimeError, match="SystemExit"):
        replica.check_health()


def test_every_listener_of_the_local_cluster_is_on_loopback(replicas):
    procs = [psutil.Process(replicas.proc.pid), *psutil.Process(replicas.proc.pid).children(recursive=True)]
    pids = {p.pid for p in procs}
    listening = [c for c in psutil.net_connections(kind="inet") if c.pid in pids and c.status == psutil.CONN_LISTEN]
    assert listening
    exposed = [(c.laddr, c.pid) for c in listening if c.laddr.ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not exposed
