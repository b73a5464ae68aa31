"""Issue 38: command-line, bench and device-check inputs, and the earlier rounds'
leftovers in their class.

Flags whose value cannot mean anything are usage errors (exit 2, naming the flag)
before anything loads: ``serve --prefix-cache-mib nan``, ``--option 'x=[[[[...'``,
``--api-key 'k '``, ``bench --timeout 0``, ``device-check --steps ''`` and an
``--output`` that cannot be written. Values that used to be coerced are refused with
a typed error naming the field: ``"3"``, ``"yes"``, ``"off"``, ``True`` as a number of
bytes, an option of 10**18. The backends allowlist can name a backend its plugin
registers (``tpu_jax_ray``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from polyengine import LLM, EngineConfig, SamplingParams
from polyengine.discovery import PluginRegistry
from polyengine.errors import InvalidRequest
from polyengine.options import Option, check_options

pytestmark = pytest.mark.filterwarnings("ignore::polyengine.models.RandomWeightsWarning")


def _polyengine(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("polyengine")
    cli = [str(script)] if script.exists() else [sys.executable, "-m", "polyengine.cli"]
    return subprocess.run([*cli, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("args, words", [
    (["serve", "--prefix-cache-mib", "nan"], ["--prefix-cache-mib", "finite"]),
    (["serve", "--prefix-cache-mib", "-1"], ["--prefix-cache-mib"]),
    (["serve", "--option", "x=" + "[" * 100_000], ["--option", "x: the value nests"]),
    (["serve", "--api-key", "sk-x "], ["--api-key", "whitespace at its end"]),
    (["bench", "--timeout", "0"], ["--timeout", "> 0"]),
    (["device-check", "--backend", "cuda_torch", "--dry-run", "--steps", ""], ["names no step"]),
    (["device-check", "--backend", "cuda_torch", "--dry-run", "--output", "/nonexistent/dir/report.md"],
     ["--output", "does not exist"]),
    (["device-check", "--backend", "cuda_torch", "--dry-run", "--json", "."], ["--json", "is a directory"]),
])
def test_a_meaningless_flag_is_a_usage_error(tmp_path, args, words):
    proc = _polyengine(tmp_path, *args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and all(w in proc.stderr for w in words), proc.stderr[-2000:]


@pytest.mark.parametrize("kwargs, field", [
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"logprobs": "off"}, "logprobs"), ({"n": "3"}, "n"),
    ({"max_tokens": 3.0}, "max_tokens"), ({"temperature": "0.5"}, "temperature"), ({"top_k": True}, "top_k"),
    ({"stop_token_ids": ["3"]}, "stop_token_ids"), ({"logit_bias": {"5": "1"}}, "logit_bias"),
])
def test_sampling_values_are_not_coerced(kwargs, field):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


def test_numpy_numbers_are_still_numbers():
    sp = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), ignore_eos=np.bool_(True))
    assert (sp.n, sp.ignore_eos) == (2, True)
    assert EngineConfig(max_slots=np.int64(3)).max_slots == 3


@pytest.mark.parametrize("kwargs, field", [
    ({"prefix_cache_bytes": True}, "prefix_cache_bytes"), ({"max_slots": "3"}, "max_slots"),
    ({"prefill_chunk": 2.5}, "prefill_chunk"),
])
def test_engine_config_values_are_not_coerced(kwargs, field):
    with pytest.raises(InvalidRequest) as err:
        LLM("random:tiny", "reference", max_cache_length=32, **kwargs)
    assert err.value.field == field


def _deep(n: int) -> list:
    value: list = []
    for _ in range(n):
        value = [value]
    return value


@pytest.mark.parametrize("value, words", [
    (10**18, "at most 2,147,483,647"), (float("nan"), "must be a int"), ("3", "must be a int"),
    (_deep(40), "nests more than"),
])
def test_backend_options_are_bounded(value, words):
    with pytest.raises(InvalidRequest, match=words) as err:
        check_options({"kv_block": Option(64, minimum=1)}, {"kv_block": value}, backend="b")
    assert err.value.field == "options.kv_block"
    assert check_options({"t": Option(30.0)}, {"t": 2.5}, backend="b")["t"] == 2.5


def test_an_option_with_choices_of_several_types_takes_each_and_nothing_else():
    """("auto", True, False): a string or a boolean of the choices; 1 (equal to True in
    Python) and other strings are refused, naming the choices."""
    table = {"repack": Option("auto", choices=("auto", True, False))}
    for value in ("auto", True, False):
        assert check_options(table, {"repack": value}, backend="b")["repack"] is value
    for value in (1, 0, 1.0, "on", None, [True]):
        with pytest.raises(InvalidRequest, match="use one of 'auto', True, False"):
            check_options(table, {"repack": value}, backend="b")


def test_the_allowlist_can_name_a_backend_its_plugin_registers(monkeypatch):
    monkeypatch.setenv("POLYENGINE_BACKENDS", "tpu_jax_ray")
    backends = PluginRegistry().backends()
    assert not backends["tpu_jax_ray"].excluded and backends["tpu_jax_ray"].spec is not None
    assert backends["tpu_jax"].excluded and backends["reference"].excluded
