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
                         "--context-length", "128", "--shutdown-timeout", "5"],
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
        async with httpx.AsyncClient(base_url=replicas.api, timeout=60) as http:
            body = {"model": MODEL, "prompt": "Once", "max_tokens": 24, "seed": 1}
            rs = await asyncio.wait_for(asyncio.gather(*(http.post("/completions", json=body) for _ in range(12))), 60)
        return rs

    rs = asyncio.run(burst())
    assert all(r.status_code in (200, 429) for r in rs) and sum(r.status_code == 200 for r in rs) >= 4
    texts = {r.json()["choices"][0]["text"] for r in rs if r.status_code == 200}
    assert len(texts) == 1  # both replicas load the same weights: same seed, same text
    # Ray Serve routes concurrent requests to the less loaded of two replicas.
    assert len({r.headers["x-polyengine-replica"] for r in rs}) == 2


def test_every_listener_of_the_local_cluster_is_on_loopback(replicas):
    procs = [psutil.Process(replicas.proc.pid), *psutil.Process(replicas.proc.pid).children(recursive=True)]
    pids = {p.pid for p in procs}
    listening = [c for c in psutil.net_connections(kind="inet") if c.pid in pids and c.status == psutil.CONN_LISTEN]
    assert listening
    exposed = [(c.laddr, c.pid) for c in listening if c.laddr.ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not exposed
