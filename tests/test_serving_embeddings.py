"""Embeddings (``LLM.embed``, ``POST /v1/embeddings``) and ``/tokenize``/``/detokenize``.

The numbers are checked against the reference backend's own forward: the mean of its
final-norm hidden states, L2-normalised (polyengine.driver.embeddings). The server runs
in-process (starlette's TestClient runs the app's lifespan) over a tiny random model,
and is driven by the official ``openai`` client where it has a method for the route.
"""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
from starlette.testclient import TestClient

from polyengine import LLM, AsyncLLM
from polyengine.backends.reference.model import ReferenceParams, hidden_states
from polyengine.errors import UnsupportedFeature
from polyengine.serving.app import build_app
from polyengine.serving.config import ServerConfig

MODEL = "random:tiny"
KEY = "sk-test-only"
CONTEXT = 64


def _expected(llm: LLM, ids: list[int], normalize: bool = True) -> np.ndarray:
    """The rule written out: mean over the prompt of the final-norm hidden states."""
    p = ReferenceParams.from_model(llm.model, np.dtype(np.float64))
    c = llm.model.config
    shape = (c.num_hidden_layers, c.num_key_value_heads, len(ids), c.head_dim)
    h = hidden_states(p, np.array([ids]), np.array([0]), [np.zeros(shape)], [np.zeros(shape)])[0]
    v = h.mean(axis=0)
    return v / np.linalg.norm(v) if normalize else v


@pytest.fixture(scope="module")
def reference():
    return LLM(MODEL, "reference", max_slots=2, max_cache_length=CONTEXT)


def test_embed_is_the_mean_of_the_final_hidden_states_on_the_torch_backends_as_on_the_reference(reference):
    prompts = ["hello world", [1, 2, 3, 4, 5]]
    ids = [reference.encode(p)[1] for p in prompts]
    got = reference.embed(prompts)
    assert got.dtype == np.float32 and got.shape == (2, reference.model.config.hidden_size)
    for row, t in zip(got, ids):
        np.testing.assert_allclose(row, _expected(reference, t), rtol=0, atol=1e-6)  # float64 pooled, float32 out
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    raw = reference.embed(prompts[0], normalize=False)[0]
    np.testing.assert_allclose(raw, _expected(reference, ids[0], normalize=False), atol=1e-6)
    # torch_common's forward (float32, padded to the prefill bucket) against the oracle, on
    # both backends that build on it (cuda_torch through its CPU stand-in)
    for backend, options in (("cpu", {}), ("cuda_torch", {"device": "cpu"})):
        torch_llm = LLM(MODEL, backend, max_slots=2, max_cache_length=CONTEXT, options=options)
        np.testing.assert_allclose(torch_llm.embed(prompts), got, rtol=0, atol=1e-5, err_msg=backend)


def _without_embeddings(llm: LLM) -> LLM:
    """The reference engine as a backend that returns no hidden states would be."""
    engine = llm.engine
    engine.capabilities = engine.capabilities.model_copy(update={"embeddings": False})
    return LLM.from_engine(engine, llm.tokenizer)


@pytest.fixture(scope="module")
def app_client():
    llm = LLM(MODEL, "reference", max_slots=2, max_cache_length=CONTEXT)
    config = ServerConfig(api_keys=(KEY,), max_slots=2, context_length=CONTEXT)
    with TestClient(build_app(config, AsyncLLM.from_llm(llm), MODEL)) as client:
        yield client, llm


def _post(client: TestClient, path: str, body: dict, key: str | None = KEY):
    return client.post(path, json=body, headers={"Authorization": f"Bearer {key}"} if key else {})


def test_the_openai_client_gets_the_python_apis_embeddings_in_both_encodings(app_client):
    client, llm = app_client
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=client, max_retries=0)
    inputs = ["hello world", "a longer sentence to embed"]
    want = llm.embed(inputs)
    for fmt in ("float", openai.NOT_GIVEN):  # not given: the client asks for base64 and decodes it
        r = oai.embeddings.create(model=MODEL, input=inputs, encoding_format=fmt)
        assert [d.index for d in r.data] == [0, 1] and r.model == MODEL
        np.testing.assert_array_equal(np.array([d.embedding for d in r.data], np.float32), want)
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(llm.encode(s)[1]) for s in inputs)
    raw = _post(client, "/v1/embeddings", {"model": MODEL, "input": [[1, 2, 3], [4, 5]], "encoding_format": "base64"})
    vecs = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in raw.json()["data"]]
    np.testing.assert_array_equal(np.stack(vecs), llm.embed([[1, 2, 3], [4, 5]]))
    one = _post(client, "/v1/embeddings", {"model": MODEL, "input": [7, 8, 9], "normalize": False}).json()
    assert one["usage"]["prompt_tokens"] == 3 and len(one["data"]) == 1
    np.testing.assert_allclose(one["data"][0]["embedding"], _expected(llm, [7, 8, 9], normalize=False), atol=1e-6)


@pytest.mark.parametrize("body, status, param, code", [
    ({"model": "other", "input": "x"}, 404, "model", "model_not_found"),
    ({"model": MODEL, "input": []}, 400, "input", None),
    ({"model": MODEL, "input": [1, 99999]}, 400, "input", None),  # outside the vocabulary
    ({"model": MODEL, "input": [list(range(1, 70))]}, 400, "input", "context_length_exceeded"),
    ({"model": MODEL, "input": "x", "dimensions": 8}, 400, "dimensions", "unsupported_parameter"),
    ({"model": MODEL, "input": "x", "encoding_format": "int8"}, 400, "encoding_format", None),
    ({"model": MODEL, "input": {"a": 1}}, 400, "input", None),
    ({"model": MODEL, "input": "x", "pooling": "last"}, 400, "pooling", None),
])
def test_bad_embedding_requests_are_typed_400s(app_client, body, status, param, code):
    r = _post(app_client[0], "/v1/embeddings", body)
    err = r.json()["error"]
    assert (r.status_code, err["param"], err["code"]) == (status, param, code), err


def test_a_backend_without_hidden_states_refuses_embeddings_by_name_and_keeps_serving():
    llm = _without_embeddings(LLM(MODEL, "reference", max_slots=2, max_cache_length=CONTEXT))
    with pytest.raises(UnsupportedFeature, match="does not support embeddings"):
        llm.embed("x")
    with TestClient(build_app(ServerConfig(), AsyncLLM.from_llm(llm), MODEL)) as client:
        r = _post(client, "/v1/embeddings", {"model": MODEL, "input": "x"}, key=None)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
        assert "does not support embeddings" in r.json()["error"]["message"]
        ok = _post(client, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}, key=None)
        assert ok.status_code == 200


def test_tokenize_and_detokenize_are_vllms_and_round_trip(app_client):
    client, llm = app_client
    r = _post(client, "/tokenize", {"model": MODEL, "prompt": "hello world", "return_token_strs": True}).json()
    assert r["tokens"] == llm.encode("hello world")[1] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == CONTEXT and r["token_strs"] == [llm.tokenizer.id_to_token(i) for i in r["tokens"]]
    msgs = [{"role": "user", "content": "Say something."}]
    chat = _post(client, "/tokenize", {"messages": msgs}).json()
    assert chat["tokens"] == llm.apply_chat_template(msgs)  # the ids a chat request runs
    back = _post(client, "/detokenize", {"model": MODEL, "tokens": r["tokens"]}).json()
    assert back == {"prompt": llm.tokenizer.decode(r["tokens"])} and "hello world" in back["prompt"]


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [1, 100000]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "prompt"),
    ("/tokenize", {}, None),
    ("/tokenize", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/tokenize", {"prompt": 5}, "prompt"),
])
def test_bad_tokenize_requests_are_typed_400s(app_client, path, body, param):
    r = _post(app_client[0], path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


def test_tokenize_needs_the_api_key_like_the_v1_routes(app_client):
    client = app_client[0]
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]}),
                       ("/v1/embeddings", {"model": MODEL, "input": "x"})):
        assert _post(client, path, body, key=None).status_code == 401
        assert _post(client, path, body, key="wrong").status_code == 401
