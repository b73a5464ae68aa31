"""The command line as a newcomer meets it: one ready line on stderr by default (details
behind -v, nothing but errors with -q) through one logging setup, a progress line with
the time a compile takes, mistakes caught before the weights load, no abbreviated flags,
a sub-command's own usage on its errors, missing extras named, ``generate --file``,
serve's flags from ``POLYENGINE_*`` and a TOML file, and chat's commands and blocks.

In-process (``main([...])`` with capsys) on the tiny random model: each test is well
under a second but the few that build an engine."""

from __future__ import annotations

import io
import logging
import os
import stat

import pytest

from polyengine.cli import build_parser, main
from polyengine.errors import InvalidRequest
from polyengine.logs import cli_logging, compiling

GEN = ["generate", "--model", "random:tiny", "--backend", "reference", "--raw", "--max-tokens", "2",
       "--temperature", "0"]


def _no_load(monkeypatch):
    """Any weight load from here on fails the test: the check must come first."""
    import polyengine.models

    def refuse(*a, **k):
        raise AssertionError("the weights were loaded before the check")

    monkeypatch.setattr(polyengine.models, "load_model", refuse)


# -- output ---------------------------------------------------------------------------


def test_one_ready_line_by_default_details_with_v_nothing_with_q(capsys):
    assert main([*GEN, "hi"]) == 0
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if not line.startswith("polyengine: warning:")]
    assert len(lines) == 1 and lines[0].startswith("random:tiny?seed=0 (random weights) on reference (cpu (NumPy)), "
                                                   "ready in "), err
    assert "polyengine: warning: RANDOM WEIGHTS" in err and err.count("RANDOM WEIGHTS") == 1  # warned and logged: once
    assert main([*GEN, "-v", "hi"]) == 0
    verbose = capsys.readouterr()
    assert verbose.out == out
    assert "loaded Model('random:tiny?seed=0' RANDOM WEIGHTS" in verbose.err
    assert "backend: reference\n  device: cpu (NumPy)\n" in verbose.err
    assert main([*GEN, "-q", "hi"]) == 0
    assert capsys.readouterr() == (out, "")  # not even the random-weights warning
    assert main(["-q", *GEN, "hi"]) == 0  # before the command too
    assert capsys.readouterr() == (out, "")


def test_the_ready_line_names_the_model_backend_and_kernels():
    from types import SimpleNamespace

    from polyengine.cli_run import ready_line

    class Engine:
        name = "cpu"

        def __init__(self, kernels):
            self.paths = {"device": "cpu (2 threads)", "isa": "avx2 (auto: ...)", "kernels": kernels}

        def speed_paths(self):
            return self.paths

    hub = SimpleNamespace(source="ORG/NAME:Q4_K_M (/cache/snapshots/abc/model.gguf)", is_random=False)
    assert ready_line(hub, Engine("compiled for this CPU (8-float vectors): /k.so"), 1.25) == (
        "ORG/NAME:Q4_K_M on cpu (kernels: compiled (avx2)), ready in 1.2s")  # .ci/run looks for "kernels: compiled"
    assert ready_line(hub, Engine("not used: no C++ compiler found"), 1.0).startswith(
        "ORG/NAME:Q4_K_M on cpu (kernels: not used (-v says why))")


def test_the_cli_logging_levels_and_that_nothing_is_left_configured(capsys):
    root, pkg = logging.getLogger(), logging.getLogger("polyengine")
    before = (list(root.handlers), root.level, list(pkg.handlers), pkg.level)
    detail = logging.getLogger("polyengine.models.loader")
    seen = {}
    for verbosity in (-1, 0, 1, 2):
        with cli_logging(verbosity):
            with compiling("the widget"):
                pass
            detail.info("an info line")
            detail.debug("a debug line")
            detail.warning("a warning line")
            detail.error("an error line")
        seen[verbosity] = capsys.readouterr().err
    assert seen[-1] == "polyengine: error: an error line\n"
    assert seen[0].splitlines()[0] == "compiling the widget (first run, cached after)..."
    assert seen[0].splitlines()[1].startswith("compiled the widget in ") and seen[0].splitlines()[1].endswith(" s")
    assert "info line" not in seen[0] and "polyengine: warning: a warning line" in seen[0]
    assert "an info line" in seen[1] and "debug" not in seen[1]
    assert "a debug line" in seen[2]
    import warnings

    with cli_logging(0), warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("from elsewhere", DeprecationWarning)
    assert capsys.readouterr().err.startswith("polyengine: warning: DeprecationWarning: from elsewhere (")
    assert (list(root.handlers), root.level, list(pkg.handlers), pkg.level) == before


def test_the_library_configures_no_logging():
    from polyengine.models import load_model

    root, pkg = logging.getLogger(), logging.getLogger("polyengine")
    before = (list(root.handlers), root.level, list(pkg.handlers), pkg.level)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_model("random:tiny")
    assert (list(root.handlers), root.level, list(pkg.handlers), pkg.level) == before


# -- parsing --------------------------------------------------------------------------


@pytest.mark.parametrize("argv, usage, hint", [
    (["generate", "--max-token", "3", "hi"], "usage: polyengine generate", "did you mean --max-tokens?"),
    (["generate", "--temprature", "0", "hi"], "usage: polyengine generate", "did you mean --temperature?"),
    (["serve", "--por", "8001"], "usage: polyengine serve", "did you mean --port?"),
    (["--vers"], "usage: polyengine [-h]", "unrecognized arguments: --vers"),
])
def test_no_abbreviations_and_a_sub_commands_own_usage(argv, usage, hint, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and usage in err and hint in err, err


# -- checks before the weights load ---------------------------------------------------


def test_options_context_length_and_tokenizer_are_checked_before_loading(monkeypatch, tmp_path, capsys):
    _no_load(monkeypatch)
    assert main([*GEN, "--option", "isa=avx2", "hi"]) == 1
    err = capsys.readouterr().err
    assert "--option: unknown option(s) ['isa'] for backend 'reference'" in err and "backends --verbose" in err
    if _has_torch():  # a value the cpu backend's table refuses (its probe needs torch installed)
        assert main([*GEN, "--backend", "cpu", "--option", "isa=avx9", "hi"]) == 1
        assert "--option: option isa='avx9' of backend 'cpu': use one of" in capsys.readouterr().err
        # neuron's table lives in a torch-free module too: its own options pass, others are refused early
        with pytest.raises(AssertionError, match="weights were loaded"):
            main([*GEN, "--backend", "neuron", "--option", "seq_buckets=[8]", "hi"])
        assert main([*GEN, "--backend", "neuron", "--option", "isa=avx2", "hi"]) == 1
        assert "--option: unknown option(s) ['isa'] for backend 'neuron'" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="weights were loaded"):  # the reference's own option passes
        main([*GEN, "--option", "page_size=16", "hi"])
    assert main([*GEN, "--context-length", "4096", "hi"]) == 1
    assert "--context-length 4096 exceeds this model's 512 positions" in capsys.readouterr().err
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 64}')
    assert main(["generate", "--model", str(folder), "--backend", "reference", "hi"]) == 1
    err = capsys.readouterr().err
    assert "has no tokenizer.json" in err and "fix: copy tokenizer.json" in err and "Traceback" not in err


def test_the_default_models_context_limit_is_read_from_its_header(monkeypatch, capsys):
    from polyengine.errors import ModelNotFound
    from polyengine.models.loader import default_model_path

    try:
        default_model_path()
    except ModelNotFound:
        pytest.skip("the default model is not installed")
    _no_load(monkeypatch)
    assert main(["generate", "--backend", "reference", "--context-length", "100000", "hi"]) == 1
    assert "exceeds this model's 8,192 positions" in capsys.readouterr().err


def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


@pytest.mark.parametrize("command, missing, extra", [
    (["conformance", "--backend", "reference"], "pytest", "pip install 'polyengine[conformance]'"),
    (["serve", "--model", "random:tiny", "--port", "0"], "fastapi", "pip install 'polyengine[serve]'"),
])
def test_commands_name_the_extra_they_need(command, missing, extra, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    _no_load(monkeypatch)
    assert main(command) == 1
    err = capsys.readouterr().err
    assert extra in err and missing in err and "Traceback" not in err, err


# -- generate --file ------------------------------------------------------------------


def test_generate_reads_the_prompt_from_a_file(tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello there\nsecond line", encoding="utf-8")
    assert main([*GEN, "-q", "hello there\nsecond line"]) == 0
    direct = capsys.readouterr().out
    assert main([*GEN, "-q", "--file", str(prompt)]) == 0
    assert capsys.readouterr().out == direct
    assert main([*GEN, "-q", "--file", str(prompt), "also this"]) == 1
    assert "were both given" in capsys.readouterr().err
    assert main([*GEN, "-q", "--file", str(tmp_path / "missing.txt")]) == 1
    assert "--file" in capsys.readouterr().err
    assert main([*GEN, "-q"]) == 1
    assert "no prompt" in capsys.readouterr().err


# -- serve's flags from the environment and a config file ----------------------------


def _serve(argv=()):
    return build_parser().parse_args(["serve", *argv])


def test_serve_flags_from_env_and_config_file_with_flag_env_file_default_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for name in [k for k in os.environ if k.startswith("POLYENGINE_")]:
        monkeypatch.delenv(name)
    assert _serve().port == 8000 and _serve().max_slots == 8  # defaults
    default = tmp_path / "xdg" / "polyengine" / "serve.toml"
    default.parent.mkdir(parents=True)
    default.write_text('port = 8100\nmax-slots = 3\nno_tools = true\nprefix-cache-partition = "salt"\n'
                       'option = {threads = 2}\nmodel = "random:tiny"\n')
    args = _serve()
    assert (args.port, args.max_slots, args.no_tools, args.prefix_cache_partition) == (8100, 3, True, "salt")
    assert dict(args.options) == {"threads": 2} and args.model == "random:tiny"
    monkeypatch.setenv("POLYENGINE_PORT", "8200")
    monkeypatch.setenv("POLYENGINE_NO_TOOLS", "false")
    monkeypatch.setenv("POLYENGINE_API_KEY", "k1,k2")  # its own variable (commas), not read here
    args = _serve()
    assert (args.port, args.max_slots, args.no_tools, args.api_key) == (8200, 3, False, None)
    assert _serve(["--port", "8300"]).port == 8300
    other = tmp_path / "other.toml"
    other.write_text("max_slots = 5\n")
    args = _serve(["--config", str(other)])
    assert (args.port, args.max_slots) == (8200, 5)  # the named file replaces the default one
    monkeypatch.setenv("POLYENGINE_CONFIG", str(other))
    assert _serve().max_slots == 5


@pytest.mark.parametrize("toml, env, words", [
    ("prot = 1\n", {}, ["unknown key 'prot'", "did you mean 'port'?"]),
    ("port = 'x'\n", {}, ["key 'port'", "'x' is not valid for --port"]),
    ("api-key = 'k'\n", {}, ["'api-key' is not read from a config file"]),
    ("", {"POLYENGINE_MAX_SLOTS": "many"}, ["environment variable POLYENGINE_MAX_SLOTS", "'many'"]),
    ("", {"POLYENGINE_ACCESS_LOG": "maybe"}, ["POLYENGINE_ACCESS_LOG='maybe'", "true"]),
    ("", {"POLYENGINE_LOG_LEVEL": "loud"}, ["'loud' is not one of"]),
    ("port = [\n", {}, ["is not valid TOML"]),
])
def test_bad_config_keys_and_values_are_typed_errors_naming_them(toml, env, words, tmp_path, monkeypatch, capsys):
    path = tmp_path / "serve.toml"
    path.write_text(toml)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(InvalidRequest) as err:
        _serve(["--config", str(path)])
    assert all(w in str(err.value) for w in words), str(err.value)
    assert main(["serve", "--config", str(path)]) == 1  # the command line says it as an error, no traceback
    assert words[0] in capsys.readouterr().err


# -- chat -----------------------------------------------------------------------------


def test_chat_help_reset_blocks_and_exit_with_piped_input(monkeypatch, capsys):
    script = '/help\n"""\nline one\nline two\n"""\n/nosuch\n"""one line"""\n/reset\n/exit\nnever read\n'
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    assert main(["chat", "--model", "random:tiny", "--backend", "reference", "--max-tokens", "2",
                 "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.count("assistant> ") == 2 and "you>" not in out and "..." not in out
    assert "/reset   forget the conversation" in err and "unknown command /nosuch" in err
    assert "(history cleared)" in err


def test_chat_message_blocks():
    from polyengine.cli_run import ChatInput, read_message

    class Lines(ChatInput):
        def __init__(self, lines):
            super().__init__(False)
            self.lines = list(lines)

        def read(self, prompt):
            return self.lines.pop(0) if self.lines else None

    assert read_message(Lines(['"""', "a", "  b", '"""'])) == "a\n  b"
    assert read_message(Lines(['"""first', "last\"\"\""])) == "first\nlast"
    assert read_message(Lines(['"""same line"""'])) == "same line"
    assert read_message(Lines(['"""', "cut short"])) == "cut short"  # end of input closes the block
    assert read_message(Lines(["plain"])) == "plain" and read_message(Lines([])) is None


def test_chat_history_is_private(tmp_path, monkeypatch):
    readline = pytest.importorskip("readline")
    from polyengine.cli_run import ChatInput, history_path

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    path = history_path()
    assert path == tmp_path / "state" / "polyengine" / "chat_history"
    path.parent.mkdir(parents=True)
    path.write_text("")
    path.chmod(0o644)  # made by someone else's umask: made private
    monkeypatch.setattr(readline, "read_history_file", lambda p: None)
    written = []
    monkeypatch.setattr(readline, "write_history_file", written.append)
    lines = ChatInput(True, path)
    lines.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and written == [str(path)]
