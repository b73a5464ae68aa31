"""Hostile inputs, round two: special files where a model or a prefix should be,
untrusted portable prefixes, lists too long in a request, refusals that must name
their field, a plugin's model resolver that exits, reports that cannot be written,
a closed output pipe, a failing optional plugin hook, advice naming options the
backend refuses, and waits for an unreachable Ray cluster. Each ends in a typed error
in bounded time (or works), run in a child under a memory limit and a deadline.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hostile_files import write_hf_folder, write_tiny_gguf
from hostile_plugins import Dist, install, polyengine
from hostile_runner import case, check, run_cases
from polyengine.errors import (
    ContextLengthExceeded, InvalidRequest, ModelConfigError, ModelNotFound, PluginError, Unreachable,
    UnsupportedFeature, WeightsError,
)

MODULE = __name__.rpartition(".")[2]


def _load(path):
    from polyengine.models import load_model

    return load_model(str(path))


def _special(path: Path, kind: str) -> Path:
    """Make ``path`` a FIFO, a link to /dev/zero or a directory."""
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    return path


# -- special files as weights (each used to hang, read forever, or be taken as absent) -----

@case(ModelNotFound, "FIFO", "not a regular file", seconds=5)
def a_fifo_as_the_model(tmp):
    _load(_special(tmp / "model.gguf", "fifo"))


@case(ModelNotFound, "character device", seconds=5)
def dev_zero_as_the_model(tmp):
    _load("/dev/zero")


@case(ModelNotFound, "character device", seconds=5)
def a_gguf_name_linked_to_dev_zero(tmp):
    _load(_special(tmp / "model.gguf", "zero"))


@case(WeightsError, "FIFO", "model.safetensors", seconds=5)
def a_fifo_as_the_weights_of_a_folder(tmp):
    folder = write_hf_folder(tmp / "m")
    _special(folder / "model.safetensors", "fifo")
    _load(folder)


@case(WeightsError, "directory", seconds=5)
def a_directory_as_the_weights_of_a_folder(tmp):
    folder = write_hf_folder(tmp / "m")
    _special(folder / "model.safetensors", "dir")
    _load(folder)


@case(WeightsError, "FIFO", seconds=5)
def a_fifo_as_the_only_gguf_of_a_folder(tmp):
    (tmp / "m").mkdir()
    _special(tmp / "m" / "model.gguf", "fifo")
    _load(tmp / "m")


for _name, _kind, _word in (("config.json", "fifo", "FIFO"), ("config.json", "dir", "directory"),
                            ("tokenizer.json", "fifo", "FIFO"), ("tokenizer.json", "zero", "character device"),
                            ("tokenizer_config.json", "fifo", "FIFO"), ("generation_config.json", "zero", "device"),
                            ("chat_template.jinja", "fifo", "FIFO")):
    def _fn(tmp, name=_name, kind=_kind):
        folder = write_hf_folder(tmp / "m")
        _special(folder / name, kind)
        _load(folder)

    _fn.__name__ = f"{_name.replace('.', '_')}_as_a_{_kind}"
    case(ModelConfigError, _name, _word, seconds=5)(_fn)


@case(None)
def a_gguf_folder_and_a_gguf_file_still_load(tmp):
    _load(write_tiny_gguf(tmp / "m.gguf"))
    _load(write_hf_folder(tmp / "hf"))


# -- untrusted portable prefixes (in the core: every engine checks them through check_portable) --

def _prefix():
    from polyengine.backends.reference.engine import ReferenceEngine
    from polyengine.engine import EngineConfig
    from polyengine.models import load_model

    model = load_model("random:tiny")
    eng = ReferenceEngine(model, EngineConfig(max_slots=1, max_cache_length=64))
    prefix, _ = eng.prefill(params=eng.load_params(), tokens=[1, 5, 9, 4], sampling=_sampling())
    return eng, eng.export_prefix(prefix)


def _sampling():
    from polyengine import SamplingParams

    return SamplingParams(seed=7)


@case(InvalidRequest, "prefix", "non-finite", seconds=15)
def a_prefix_with_nan_k(tmp):
    eng, p = _prefix()
    p.k[0, 0, 1, 2] = np.nan
    eng.import_prefix(p)


@case(InvalidRequest, "prefix", "non-finite", "logits", seconds=15)
def a_prefix_with_infinite_logits(tmp):
    eng, p = _prefix()
    p.last_logits[3] = np.inf
    eng.import_prefix(p)


@case(InvalidRequest, "prefix", "outside the vocabulary", seconds=15)
def a_prefix_with_ids_outside_the_vocabulary(tmp):
    eng, p = _prefix()
    p.prompt_tokens[1] = 100_000
    eng.import_prefix(p)


@case(InvalidRequest, "int32", seconds=15)
def a_prefix_with_an_id_beyond_int32_never_wraps(tmp):
    from safetensors.numpy import load, save

    from polyengine.prefix import PortablePrefix

    _, p = _prefix()
    data = p.to_bytes()
    tensors = load(data)
    tensors["prompt_tokens"] = np.array([1, 2**32 + 5, 9, 4], np.int64)  # 2**32 + 5 would wrap to 5
    meta = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    PortablePrefix.from_bytes(save(tensors, metadata=meta))


@case(InvalidRequest, "floating-point", seconds=15)
def a_prefix_with_integer_k(tmp):
    from polyengine.prefix import PortablePrefix

    _, p = _prefix()
    PortablePrefix(k=p.k.astype(np.int64), v=p.v, prompt_tokens=p.prompt_tokens, last_logits=p.last_logits,
                   sampling=p.sampling, model_fingerprint=p.model_fingerprint)


@case(InvalidRequest, "__metadata__", seconds=15)
def a_prefix_whose_header_is_a_list(tmp):
    from polyengine.prefix import PortablePrefix

    header = b"[1, 2, 3]"
    PortablePrefix.from_bytes(len(header).to_bytes(8, "little") + header)


@case(InvalidRequest, "FIFO", seconds=5)
def a_prefix_file_that_is_a_fifo(tmp):
    from polyengine.prefix import PortablePrefix

    PortablePrefix.load(_special(tmp / "p.safetensors", "fifo"))


@case(InvalidRequest, "character device", seconds=5)
def a_prefix_file_that_is_dev_zero(tmp):
    from polyengine.prefix import PortablePrefix

    PortablePrefix.load("/dev/zero")


# -- request lists and the fields refusals name ----------------------------------------------

@case(InvalidRequest, "stop", "at most 64", seconds=5)
def a_hundred_thousand_stop_strings(tmp):
    from polyengine import SamplingParams

    try:
        SamplingParams(stop=["x"] * 100_000)
    except InvalidRequest as exc:
        assert exc.field == "stop" and len(str(exc)) < 1000, (exc.field, len(str(exc)))
        raise


@case(InvalidRequest, "logit_bias", "at most", seconds=5)
def a_huge_logit_bias(tmp):
    from polyengine import SamplingParams

    SamplingParams(logit_bias={i: 1.0 for i in range(100_000)})


@case(None)
def every_refusal_names_its_field(tmp):
    import polyengine as pe

    llm = pe.LLM("random:tiny", "reference", max_cache_length=64, max_slots=2, tools=False)
    expect = {
        "prompt": lambda: llm.generate([[]], {"max_tokens": 2}),
        "max_tokens": lambda: llm.generate(["hi"], {"max_tokens": 0}),
        "n": lambda: llm.generate(["hi"], {"n": 3}),
        "logit_bias": lambda: llm.generate(["hi"], {"logit_bias": {10_000: 1.0}}),
        "stop_token_ids": lambda: llm.generate(["hi"], {"stop_token_ids": [10_000]}),
        "messages": lambda: llm.chat([{"role": "user", "content": "x" * 100_000}]),
        "max_cache_length": lambda: pe.LLM("random:tiny", "reference", max_cache_length=100_000),
        "options.nope": lambda: pe.LLM("random:tiny", "reference", options={"nope": 1}),
        "dtype": lambda: pe.LLM("random:tiny", "reference", dtype="int3"),
    }
    for field, call in expect.items():
        try:
            call()
        except (InvalidRequest, UnsupportedFeature) as exc:
            assert exc.field == field, (field, exc.field, str(exc))
        else:
            raise AssertionError(f"{field}: not refused")
    try:
        llm.generate([list(range(1, 100))], {"max_tokens": 2})
    except ContextLengthExceeded as exc:
        assert exc.field == "prompt"
    else:
        raise AssertionError("a prompt over max_prefill_length was not refused")


# -- plugins, advice ---------------------------------------------------------------------------

@case(PluginError, "exiting-models", "sys.exit", "other models still load", seconds=10)
def a_model_resolver_that_exits(tmp):
    import polyengine as pe

    class Plugin:
        @pe.hookimpl
        def polyengine_models(self):
            def resolve():
                raise SystemExit(4)
            return {"exiting": resolve}

    pe.register_plugin(Plugin(), "exiting-models")
    from polyengine.models import load_model

    load_model("exiting")


@case(None)
def memory_advice_names_only_dtypes_the_engine_declares(tmp):
    from polyengine.errors import InsufficientMemory
    from polyengine.memory import simulated_limit
    from polyengine.engine import Capabilities, EngineBase, EngineConfig
    from polyengine.models import load_model

    model = load_model("random:tiny")

    class Float32Only(EngineBase):
        name = "float32_only"

    eng = Float32Only(model, EngineConfig(max_slots=1, max_cache_length=64), Capabilities(dtypes=("float32",)))
    try:
        with simulated_limit(1):
            eng.check_memory({"a cache": 1 << 20})
    except InsufficientMemory as exc:
        assert "dtype" not in str(exc) and "--dtype" not in str(exc), str(exc)
    else:
        raise AssertionError("not refused")
    eng = Float32Only(model, EngineConfig(max_slots=1, max_cache_length=64),
                      Capabilities(dtypes=("float32", "bfloat16")))
    try:
        with simulated_limit(1):
            eng.check_memory({"a cache": 1 << 20})
    except InsufficientMemory as exc:
        assert "dtype='bfloat16'" in str(exc) and "--dtype bfloat16" in str(exc), str(exc)


# -- reports ---------------------------------------------------------------------------------

@case(InvalidRequest, "cannot write", "nothing was run", seconds=5)
def a_report_under_a_regular_file(tmp):
    from polyengine.files import check_writable

    (tmp / "file").write_text("x")
    check_writable(tmp / "file" / "report.json", what="JSON report", error=InvalidRequest)


@case(None)
def a_report_that_fails_at_the_end_is_kept(tmp):
    from polyengine.files import write_report

    (tmp / "file").write_text("x")
    where = write_report(tmp / "file" / "report.json", '{"finished": true}', what="JSON report")
    assert where.read_text() == '{"finished": true}' and where.parent != tmp / "file"
    where.unlink()


# -- unreachable systems ---------------------------------------------------------------------

def _silent_port() -> tuple[socket.socket, int]:
    """A loopback port that accepts connections and never says a word."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s, s.getsockname()[1]


@case(Unreachable, "127.0.0.1:1", "refused", seconds=5)
def a_refused_address(tmp):
    from polyengine.remote import check_reachable

    check_reachable("ray://127.0.0.1:1", 2.0, "the Ray cluster")


@case(Unreachable, "did not answer within 1 s", seconds=5)
def a_silent_address(tmp):
    import time

    from polyengine.remote import call_with_deadline, check_reachable

    s, port = _silent_port()
    check_reachable(f"127.0.0.1:{port}", 2.0, "it")  # the port opens...
    call_with_deadline(lambda: time.sleep(30), 1.0, address=f"127.0.0.1:{port}", what="it")  # ...nothing answers


def test_hostile_leftovers(tmp_path):
    results = run_cases(MODULE, tmp_path)
    problems = check(MODULE, results)
    assert not problems, "\n".join(problems)


# -- the command line, in subprocesses ----------------------------------------------------------

def test_a_closed_output_pipe_ends_quietly(tmp_path):
    """`polyengine generate ... | head -c1`: no traceback, the status of a stopped pipe."""
    proc = subprocess.Popen([sys.executable, "-m", "polyengine.cli", "generate", "--model", "random:tiny",
                             "--backend", "reference", "--max-tokens", "60", "--seed", "1", "--raw", "hello"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    proc.stdout.read(1)
    proc.stdout.close()  # the reader goes away
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("argv", [
    ["conformance", "--backend", "reference", "--report-json", "{tmp}/file/report.json"],
    ["bench", "--quick", "--backend", "reference", "--peers", "none", "--json", "{tmp}/file/bench.json"],
])
def test_an_unwritable_report_path_fails_before_the_run(tmp_path, argv):
    (tmp_path / "file").write_text("a regular file, not a folder")
    proc = subprocess.run([sys.executable, "-m", "polyengine.cli", *(a.format(tmp=tmp_path) for a in argv)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "cannot write" in proc.stderr and "nothing was run" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_failing_optional_hook_is_listed_broken_and_others_keep_working(tmp_path):
    site = install(tmp_path, [Dist("hook-fails", "hook_fails", {"plugin": '''
        @hookimpl
        def polyengine_tools():
            raise RuntimeError("tools exploded")

        @hookimpl
        def polyengine_backends():
            return [spec("still_works")]
        '''}, {"polyengine.backends": {"hook_fails": "hook_fails.plugin"}})])
    proc = polyengine(site, "backends", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["hook_fails"]["broken"] and "tools exploded" in rows["hook_fails"]["error"], rows["hook_fails"]
    assert "its tools are left out" in rows["hook_fails"]["error"]
    assert rows["still_works"]["available"] and not rows["still_works"]["broken"]
    proc = polyengine(site, "generate", "--backend", "still_works", "--model", "random:tiny", "--max-tokens", "2",
                      "--seed", "1", "--json", "hi")
    assert proc.returncode == 0 and len(json.loads(proc.stdout)["token_ids"]) == 2, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("silent", [False, True], ids=["refused", "silent"])
def test_an_unreachable_ray_address_fails_in_bounded_time(tmp_path, silent):
    """tpu_jax_ray's ray_address and `serve --ray-address`: a refused port and one that
    accepts but never answers both end in Unreachable naming the address, within the
    connect timeout, never after Ray's minutes of retries."""
    pytest.importorskip("ray")
    listener, port = _silent_port() if silent else (None, 1)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    try:
        code = (f"import polyengine\n"
                f"polyengine.create_engine('tpu_jax_ray', model='random:tiny', max_slots=1, max_cache_length=64, "
                f"options={{'ray_address': '127.0.0.1:{port}', 'connect_timeout_s': 2.0}})\n")
        runs = [[sys.executable, "-c", code],
                [sys.executable, "-m", "polyengine.serving", "--model", "random:tiny", "--backend", "reference",
                 "--replicas", "1", "--port", "18999", "--ray-address", f"127.0.0.1:{port}",
                 "--ray-connect-timeout", "2"]]
        for argv in runs:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
            assert proc.returncode == 1, proc.stderr
            assert f"127.0.0.1:{port}" in proc.stderr, proc.stderr
            assert ("did not answer within 2 s" if silent else "refused") in proc.stderr, proc.stderr
    finally:
        if listener is not None:
            listener.close()
