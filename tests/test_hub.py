"""Models by name (``--model ORG/NAME[@REV][:QUANT]``, ``polyengine pull``, ``polyengine
models``) against a local stand-in for the Hugging Face Hub (tests/hub_standin.py), so
huggingface_hub's real client code runs: listing, HEAD + GET of each file, its cache,
offline mode, tokens. Nothing here reaches past 127.0.0.1.

The in-process tests point huggingface_hub at the stand-in by setting its environment
variables and reloading ``huggingface_hub.constants`` (which reads them at import), as a
fresh process with those variables would; the first test runs the CLI in fresh processes.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import polyengine
from hostile_files import write_hf_folder
from hub_standin import HubStandin
from imports import imported_by
from polyengine.cli import main
from polyengine.errors import MissingExtra, ModelNotFound, UnsupportedFeature
from polyengine.models import load_model
from polyengine.models.hub import HubName, parse_hub_name, resolve, select_files
from polyengine.models.presets import preset_config, random_weights
from polyengine.models.quant_presets import quantized_model_file

hf_constants = pytest.importorskip("huggingface_hub.constants")

# What a safetensors repo holds that the engine does not read: none of it may be fetched.
NOT_NEEDED = {"README.md": b"# tiny", "pytorch_model.bin": b"not a pickle anyone should load",
              "onnx/model.safetensors": b"an export in a subfolder", "generation_config.json": b"{}"}
NEEDED = {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"}
TOKEN = "hf_standin_secret"


def _folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """Repository contents: a tiny safetensors model in two versions and a GGUF repo with
    two quants (a few hundred KB each, written once)."""
    tmp = tmp_path_factory.mktemp("hub_repos")
    v1 = _folder_files(write_hf_folder(tmp / "v1"))
    v2 = _folder_files(write_hf_folder(tmp / "v2", weights=random_weights(preset_config("tiny"), seed=7)))
    ggufs = {f"tiny-{q}.gguf": quantized_model_file(q, tmp).read_bytes() for q in ("Q8_0", "Q4_0")}
    return {"v1": {**v1, **NOT_NEEDED}, "v2": {**v2, **NOT_NEEDED}, "gguf": {**ggufs, "README.md": b"quants"}}


def _point_hub_client(mp: pytest.MonkeyPatch, **env: str | None) -> None:
    for key, value in env.items():
        if value is None:
            mp.delenv(key, raising=False)
        else:
            mp.setenv(key, value)
    importlib.reload(hf_constants)


class Hub:
    """The stand-in plus the environment that points huggingface_hub at it."""

    def __init__(self, server: HubStandin, mp: pytest.MonkeyPatch, home: Path):
        self.server, self.mp, self.home = server, mp, home

    def offline(self) -> None:
        self.server.stop()
        _point_hub_client(self.mp, HF_HUB_OFFLINE="1")

    def token(self, value: str | None) -> None:
        _point_hub_client(self.mp, HF_TOKEN=value)


@pytest.fixture
def hub(tmp_path, repos):
    with HubStandin() as server, pytest.MonkeyPatch.context() as mp:
        server.commit("org/tiny", repos["v1"], ref="v1")
        server.commit("org/tiny", repos["v2"], ref="main")
        server.commit("org/tiny-gguf", repos["gguf"])
        server.commit("org/gated", repos["gguf"], token=TOKEN)
        _point_hub_client(mp, HF_ENDPOINT=server.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=None,
                          HF_TOKEN=None, HF_HUB_OFFLINE=None, HF_HUB_DISABLE_PROGRESS_BARS=None, TQDM_POSITION=None)
        yield Hub(server, mp, tmp_path / "hf")
    importlib.reload(hf_constants)  # back to this process's own environment


def test_generate_by_name_then_offline_from_cache(hub, tmp_path, capsys):
    """The newcomer's path: `generate --model org/tiny` downloads only the files the
    engine reads; then, with the stand-in gone, a fresh process with HF_HUB_OFFLINE=1
    (the variable as a user sets it) gives the same answer from the cache."""
    args = ["generate", "--model", "org/tiny", "--backend", "reference", "--temperature", "0", "--max-tokens", "4",
            "--raw", "--json", "hi"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert set(hub.server.fetched()) == NEEDED and len(first["token_ids"]) == 4
    hub.server.stop()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TQDM_"))}
    env.update(HF_HOME=str(hub.home), HF_ENDPOINT=hub.server.url, HF_HUB_OFFLINE="1")
    offline = subprocess.run([sys.executable, "-m", "polyengine.cli", *args], env=env, capture_output=True,
                             text=True, timeout=120, cwd=tmp_path)
    assert offline.returncode == 0, offline.stderr
    assert json.loads(offline.stdout)["token_ids"] == first["token_ids"]  # the stand-in is gone: the cache answered


def test_quant_tag_picks_one_gguf_file(hub):
    path = resolve(parse_hub_name("org/tiny-gguf:q8_0"))  # case-insensitive, as llama.cpp's -hf
    assert path.name == "tiny-Q8_0.gguf" and path.is_file()
    assert hub.server.fetched() == ["tiny-Q8_0.gguf"]
    assert resolve(parse_hub_name("org/tiny-gguf:tiny-Q4_0.gguf")).name == "tiny-Q4_0.gguf"
    model = load_model("org/tiny-gguf:Q8_0")
    assert model.meta["format"] == "gguf" and "Q8_0" in model.meta["quantization"]
    from polyengine.benchmarks.cli import _model_file

    assert _model_file("org/tiny-gguf:Q8_0")[0] == path  # bench's peers (llama.cpp) read the same file
    with pytest.raises(ModelNotFound, match=r"no GGUF file matches the quant tag 'Q5_K_M'.*tiny-Q4_0\.gguf, "
                                            r"tiny-Q8_0\.gguf"):
        resolve(parse_hub_name("org/tiny-gguf:Q5_K_M"))
    with pytest.raises(ModelNotFound, match="several GGUF files and none is Q4_K_M"):
        resolve(parse_hub_name("org/tiny-gguf"))


def test_selection_rules():
    files = ["a-Q4_K.gguf", "a-Q4_K_M.gguf", "a-IQ4_XS.gguf", "b/a-Q8_0-00001-of-00002.gguf",
             "b/a-Q8_0-00002-of-00002.gguf", "README.md"]
    assert select_files(HubName("o/a", selector="Q4_K"), files) == ("gguf", ["a-Q4_K.gguf"])  # not Q4_K_M
    assert select_files(HubName("o/a"), files) == ("gguf", ["a-Q4_K_M.gguf"])  # llama.cpp's default quant
    with pytest.raises(ModelNotFound, match="matches several"):
        select_files(HubName("o/a", selector="4"), ["a-4-x.gguf", "b-4.gguf"])
    with pytest.raises(UnsupportedFeature, match="split"):
        select_files(HubName("o/a", selector="Q8_0"), files)
    with pytest.raises(ModelNotFound, match="never loaded"):
        select_files(HubName("o/a"), ["config.json", "pytorch_model.bin"])
    sharded = ["config.json", "tokenizer.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
               "consolidated.safetensors"]
    assert select_files(HubName("o/a"), sharded) == ("folder", ["config.json", "tokenizer.json",
                                                                "model.safetensors.index.json"])
    assert parse_hub_name("hf.co/org/m@refs/pr/1:Q4_K_M") == HubName("org/m", "refs/pr/1", "Q4_K_M")
    for not_a_name in ("tiny", "org/", "/abs/path", "models/x.gguf", "org/m:", "org/m@", "org/m@../x", "a--b/c",
                       "random:tiny"):
        assert parse_hub_name(not_a_name) is None, not_a_name


def test_revision_pinning(hub):
    main_sha, v1_sha = hub.server.repos["org/tiny"].refs["main"], hub.server.repos["org/tiny"].refs["v1"]
    assert resolve(parse_hub_name("org/tiny")).name == main_sha
    assert resolve(parse_hub_name("org/tiny@v1")).name == v1_sha
    assert resolve(parse_hub_name(f"org/tiny@{v1_sha}")).name == v1_sha
    pinned, latest = load_model("org/tiny@v1", dtype="float32"), load_model("org/tiny", dtype="float32")
    name = "model.embed_tokens.weight"
    assert (pinned.weights[name] != latest.weights[name]).any()
    with pytest.raises(ModelNotFound, match="no revision 'v9'"):
        resolve(parse_hub_name("org/tiny@v9"))
    with pytest.raises(ModelNotFound, match="no such repository"):
        resolve(parse_hub_name("org/nothing"))
    hub.offline()  # the tag's commit was recorded in the cache: the pinned name works offline
    assert resolve(parse_hub_name("org/tiny@v1")).name == v1_sha


def test_sharded_checkpoint_fetches_the_shards_its_index_names(hub, tmp_path):
    names = sorted(random_weights(preset_config("tiny")))
    folder = write_hf_folder(tmp_path / "sharded", shards={"model-00001-of-00002.safetensors": names[:5],
                                                           "model-00002-of-00002.safetensors": names[5:]})
    hub.server.commit("org/sharded", {**_folder_files(folder), "consolidated.safetensors": b"another layout"})
    model = load_model("org/sharded", dtype="float32")
    assert set(model.weights) == set(names)
    assert set(hub.server.fetched()) == NEEDED - {"model.safetensors"} | {
        "model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}


def test_hf_token_is_sent_as_bearer(hub):
    with pytest.raises(ModelNotFound, match="gated or private.*HF_TOKEN"):
        resolve(parse_hub_name("org/gated:Q8_0"))
    hub.token(TOKEN)
    assert resolve(parse_hub_name("org/gated:Q8_0")).name == "tiny-Q8_0.gguf"
    asked = [auth for method, path, auth in hub.server.requests if path.startswith(("/org/gated", "/api/models/org/gated"))]
    assert asked[-3:] == [f"Bearer {TOKEN}"] * 3  # the listing, the HEAD and the GET


def test_offline_names_what_is_missing(hub):
    resolve(parse_hub_name("org/tiny-gguf:Q8_0"))
    hub.offline()
    llm = polyengine.LLM(model="org/tiny-gguf:Q8_0", backend="reference", max_slots=1, max_cache_length=16)
    assert llm.model.meta["format"] == "gguf"
    with pytest.raises(ModelNotFound, match=r"org/other is not in the Hugging Face cache .*HF_HUB_OFFLINE is set.*"
                                            r"polyengine pull org/other"):
        load_model("org/other")
    with pytest.raises(ModelNotFound, match=r"'Q4_0'; its GGUF files: tiny-Q8_0\.gguf .*\(these are the files cached"):
        load_model("org/tiny-gguf:Q4_0")


def test_pull_and_models(hub, capsys):
    hub.mp.setenv("TQDM_POSITION", "-1")  # huggingface_hub's bars show on a terminal only; forced on here
    assert main(["pull", "org/tiny-gguf:Q4_0"]) == 0
    out, err = capsys.readouterr()
    assert Path(out.strip()).name == "tiny-Q4_0.gguf" and Path(out.strip()).is_file()
    assert "tiny-Q4_0.gguf" in err and "100%" in err  # the progress bar, on stderr
    assert main(["pull", "-q", "org/tiny@v1"]) == 0
    out, err = capsys.readouterr()
    assert (Path(out.strip()) / "model.safetensors").is_file() and "%" not in err
    assert main(["models", "--json"]) == 0
    rows = {r["repo"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["org/tiny-gguf"]["names"] == ["org/tiny-gguf:tiny-Q4_0.gguf"] and rows["org/tiny-gguf"]["format"] == "gguf"
    assert rows["org/tiny"]["refs"] == ["v1"] and rows["org/tiny"]["names"] == ["org/tiny@v1"]
    assert set(rows["org/tiny"]["files"]) == NEEDED and rows["org/tiny"]["size_bytes"] > 0
    assert main(["models"]) == 0
    table = capsys.readouterr().out
    assert "org/tiny@v1" in table and "safetensors" in table and "gguf" in table
    assert main(["pull", "not-a-name"]) == 1
    assert "not a Hugging Face name" in capsys.readouterr().err


def test_paths_and_other_names_keep_their_meaning(hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_hf_folder(tmp_path / "org" / "tiny")  # a local folder spelled like the hub name wins
    assert load_model("org/tiny").source == "org/tiny"
    for name in ("no-such-model", "missing/model.gguf"):
        with pytest.raises(ModelNotFound, match="not an existing path"):
            load_model(name)
    assert hub.server.requests == []  # none of them asked the hub


def test_missing_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(MissingExtra, match=r"pip install 'polyengine\[hub\]'"):
        load_model("org/tiny")
    # The core, and every command's parser, import it only when a hub name is used.
    assert imported_by("from polyengine.cli import build_parser; build_parser()", ["huggingface_hub"]) == []
