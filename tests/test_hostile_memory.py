"""Hostile inputs, class "guards that look at the wrong limit": the one memory check
(:mod:`polyengine.memory`) sees ``ulimit -v`` / ``ulimit -d`` and cgroup limits, not just
MemAvailable; an engine's own allocation failure surfaces as InsufficientMemory (not a
raw NumPy traceback, not a PluginError); and the advice names flags and arguments that
exist. The cases run in a child under a 3 GiB address-space limit (``ulimit -v``).
"""

from __future__ import annotations

import numpy as np

from hostile_runner import case, check, run_cases
from polyengine.errors import InsufficientMemory

LIMIT = 3 * 1024**3


@case(None)
def the_check_sees_the_address_space_limit(tmp):
    from polyengine.memory import available_host_memory, host_memory_limits

    limits = host_memory_limits()
    assert "ulimit -v" in limits, limits
    assert available_host_memory() <= LIMIT


@case(InsufficientMemory, "ulimit -v", "fewer parameters", seconds=10)
def weights_beyond_the_address_space_limit_are_refused_before_loading(tmp):
    from polyengine.models import load_model

    load_model("random:llama-1b")  # 1.2 B parameters: 4.6 GiB of float32 weights


@case(InsufficientMemory, "--context-length", "max_cache_length", "ulimit -v", seconds=10)
def kv_caches_beyond_the_limit_are_refused_with_followable_advice(tmp):
    import polyengine as pe

    pe.LLM("random:tiny", "reference", max_slots=4096, max_cache_length=512)


def _register_greedy_backend(where: str):
    """A backend whose ``where`` step asks NumPy for 8 TiB (what a real out-of-memory looks like)."""
    import polyengine as pe
    from polyengine.backends.reference.engine import ReferenceEngine

    class Greedy(ReferenceEngine):
        name = "greedy"

        def __init__(self, model, config):
            if where == "factory":
                np.ones(2**43, np.uint8)
            super().__init__(model, config)

        def init_decode_state(self):
            if where == "init_decode_state":
                np.ones(2**43, np.uint8)
            return super().init_decode_state()

        def prefill(self, *, params, tokens, sampling, existing_prefix=None, token_mask=None):
            if where == "prefill":
                np.ones(2**43, np.uint8)
            return super().prefill(params=params, tokens=tokens, sampling=sampling, existing_prefix=existing_prefix,
                                   token_mask=token_mask)

        def generate(self, params, decode_state, *, overrides=None, token_masks=None):
            if where == "generate":
                np.ones(2**43, np.uint8)
            return super().generate(params, decode_state, overrides=overrides, token_masks=token_masks)

    class Plugin:
        @pe.hookimpl
        def polyengine_backends(self):
            return [pe.BackendSpec(name="greedy", description="asks for too much", protocol_version=pe.PROTOCOL_VERSION,
                                   probe=lambda: pe.Probe(True), factory=Greedy)]

    pe.register_plugin(Plugin(), "greedy-plugin")


def _greedy(where: str):
    import polyengine as pe

    _register_greedy_backend(where)
    try:
        llm = pe.LLM("random:tiny", "greedy", max_cache_length=64)
        llm.generate(["hi"], {"max_tokens": 2})
    finally:
        pe.unregister_plugin("greedy-plugin")
        llm = pe.LLM("random:tiny", "reference", max_cache_length=64)  # the process is still fine
        assert len(llm.generate(["ok"], {"max_tokens": 2, "ignore_eos": True})[0].token_ids) == 2


@case(InsufficientMemory, "greedy", "TiB", seconds=10)
def an_engine_that_runs_out_of_memory_in_its_factory(tmp):
    _greedy("factory")


@case(InsufficientMemory, "greedy", "TiB", seconds=10)
def an_engine_that_runs_out_of_memory_allocating_its_caches(tmp):
    _greedy("init_decode_state")


@case(InsufficientMemory, "greedy", "TiB", seconds=10)
def an_engine_that_runs_out_of_memory_in_prefill(tmp):
    _greedy("prefill")


@case(InsufficientMemory, "greedy", "TiB", seconds=10)
def an_engine_that_runs_out_of_memory_in_generate(tmp):
    _greedy("generate")


def test_memory_guards_see_the_real_limit_and_advise_what_exists(tmp_path):
    results = run_cases(__name__.rpartition(".")[2], tmp_path, memory=LIMIT)
    problems = check(__name__.rpartition(".")[2], results)
    assert not problems, "\n".join(problems)


def test_the_data_segment_limit_counts_too(tmp_path):
    import subprocess
    import sys

    script = (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_DATA, (2 * 1024**3, resource.RLIM_INFINITY))\n"
        "from polyengine.memory import available_host_memory, host_memory_limits\n"
        "limits = host_memory_limits()\n"
        "assert 'ulimit -d' in limits, limits\n"
        "assert available_host_memory() <= 2 * 1024**3\n"
        "from polyengine.models import load_model\n"
        "try:\n"
        "    load_model('random:llama-1b')\n"
        "except MemoryError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("InsufficientMemory") and "ulimit -d" in proc.stdout


def test_cgroup_limits_are_read_from_this_process_cgroup_and_its_ancestors(tmp_path):
    from polyengine.memory import cgroup_available

    root = tmp_path / "cgroup"
    leaf = root / "user.slice" / "job"
    leaf.mkdir(parents=True)
    (root / "user.slice" / "memory.max").write_text(f"{8 * 1024**3}\n")
    (root / "user.slice" / "memory.current").write_text(f"{7 * 1024**3}\n")
    (leaf / "memory.max").write_text("max\n")
    (leaf / "memory.current").write_text(f"{1024**3}\n")
    proc_cgroup = tmp_path / "cgroup-of-self"
    proc_cgroup.write_text("0::/user.slice/job\n")
    # The parent's limit binds: 8 GiB minus its 7 GiB in use.
    assert cgroup_available(root=root, self_cgroup=proc_cgroup) == 1024**3
    (leaf / "memory.max").write_text(f"{1024**3 + 512}\n")
    assert cgroup_available(root=root, self_cgroup=proc_cgroup) == 512
    # cgroup v1: the memory controller's own hierarchy.
    v1 = tmp_path / "v1"
    (v1 / "memory" / "docker" / "abc").mkdir(parents=True)
    (v1 / "memory" / "docker" / "abc" / "memory.limit_in_bytes").write_text(f"{2 * 1024**3}\n")
    (v1 / "memory" / "docker" / "abc" / "memory.usage_in_bytes").write_text(f"{1024**3}\n")
    proc_cgroup.write_text("12:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    assert cgroup_available(root=v1, self_cgroup=proc_cgroup) == 1024**3


def test_cli_advice_names_flags_that_exist(tmp_path):
    """The reference engine's float64 copy of a 135M-parameter model does not fit under
    the limit, though the float32 weights do: the advice must be followable from here."""
    import resource

    def limit():  # the float32 weights fit under it, the engine's float64 copy and caches do not
        resource.setrlimit(resource.RLIMIT_AS, (int(2.25 * 1024**3), int(2.25 * 1024**3)))

    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "polyengine.cli", "generate", "--model", "random:smollm2-135m", "--backend",
         "reference", "--context-length", "8192", "--max-tokens", "1", "hi"],
        capture_output=True, text=True, timeout=120, preexec_fn=limit,
    )
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr
    assert "InsufficientMemory" not in err and "Traceback" not in err, err
    assert "--context-length" in err and "--dtype" in err and "ulimit -v" in err, err
    assert "--max-slots" not in err
