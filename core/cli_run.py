"""CLI commands that run a model: ``generate`` (one prompt, streamed or JSON) and
``chat`` (interactive, with history).

Input from the command line and the terminal is untrusted text: undecodable bytes
arrive as lone surrogates and are refused with an error (the chat session goes on),
a chat line is read with a bound (:data:`~polyengine.limits.MAX_CHAT_LINE_CHARS`), and
every flag is checked for what it means (``--context-length 0`` is an error, not "the
default"; ``--model ""`` is an error, not the current directory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from polyengine.errors import InvalidRequest, PolyengineError
from polyengine.limits import DEFAULT_CONTEXT_LENGTH, MAX_CHAT_LINE_CHARS, MAX_JSON_DEPTH, json_depth

__all__ = ["add_commands", "add_engine_config_args", "engine_config_kwargs", "nonnegative_number", "positive_number"]


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", help="backend name or 'auto' (see `polyengine backends`)")
    p.add_argument("--model", default=None,
                   help="GGUF file, HF folder, Hugging Face name (ORG/NAME, ORG/NAME:Q4_K_M, ORG/NAME@REVISION; "
                        "docs/models.md), plugin model name or random:<preset> (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None, help="compute dtype (backend default if omitted)")
    p.add_argument("--context-length", type=int, default=None,
                   help="prompt + completion tokens per request, the engine's max_cache_length "
                        f"(default: {DEFAULT_CONTEXT_LENGTH}, or the model's limit if smaller)")
    p.add_argument("--max-tokens", type=int, default=256, help="completion tokens at most")
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (random and reported if omitted)")
    p.add_argument("--no-tools", action="store_true", help="disable the calculator tool")
    add_verbosity_args(p)
    add_engine_config_args(p)


def add_verbosity_args(p: argparse.ArgumentParser, *, dest_prefix: str = "") -> None:
    """``-q``/``-v``: what a command writes to stderr (:mod:`polyengine.logs`). By default
    one line when the model is ready (and a line for each compile that takes seconds)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("-q", "--quiet", dest=f"{dest_prefix}quiet", action="store_true",
                   help="nothing on stderr but errors")
    g.add_argument("-v", "--verbose", dest=f"{dest_prefix}verbose", action="count", default=0,
                   help="more on stderr: weight loading, every speed path with its fallback and fix; -vv: debug lines")


def verbosity(args: argparse.Namespace) -> int:
    """-1 (``-q``), 0 (default), 1 (``-v``), 2 (``-vv``): the sub-command's flags and the
    top-level ones (``polyengine -v serve``) together."""
    if getattr(args, "quiet", False) or getattr(args, "top_quiet", False):
        return -1
    return int(getattr(args, "verbose", 0) or 0) + int(getattr(args, "top_verbose", 0) or 0)


def _number(text: str, *, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")) or value < 0 or (positive and value == 0):
        raise argparse.ArgumentTypeError(f"expected a finite number {'> 0' if positive else '>= 0'}, got {text!r}")
    return value


def positive_number(text: str) -> float:
    """An argparse type: a finite number > 0 (seconds, sizes); anything else is a usage error."""
    return _number(text, positive=True)


def nonnegative_number(text: str) -> float:
    """An argparse type: a finite number >= 0 (where 0 turns something off)."""
    return _number(text, positive=False)


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r} (e.g. --option isa=avx2)")
    try:
        parsed = json.loads(value)  # numbers, booleans, lists: [128, 1024]
        too_deep = json_depth(parsed, MAX_JSON_DEPTH) > MAX_JSON_DEPTH
    except RecursionError:  # nested past what json can parse
        too_deep = True
    except ValueError:
        return key.strip(), value  # a bare word is a string: isa=avx2
    if too_deep:
        raise argparse.ArgumentTypeError(f"--option {key.strip()}: the value nests more than {MAX_JSON_DEPTH} levels")
    return key.strip(), parsed


def _buckets(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r} (e.g. 128,1024)") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one token count (e.g. 128,1024)")
    return values


def add_engine_config_args(p: argparse.ArgumentParser) -> None:
    """The engine settings the commands that build one share (generate, chat, serve):
    backend options (`polyengine backends --verbose` lists each backend's, which refuses
    an unknown one naming the field) and the static prefill shapes."""
    p.add_argument("--option", dest="options", action="append", type=_option, default=[], metavar="KEY=VALUE",
                   help="a backend option, repeatable; VALUE is JSON or a bare word (e.g. --option isa=avx2, "
                        "--option seq_buckets=[1024]; `polyengine backends --verbose` lists them)")
    p.add_argument("--prefill-buckets", type=_buckets, default=None, metavar="N,N,...",
                   help="prompt lengths compiled as static prefill shapes, for backends that compile them "
                        "(neuron, tpu_jax); default: powers of two up to the context")


def engine_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields from :func:`add_engine_config_args`'s flags, only those given."""
    out: dict[str, Any] = {}
    if args.options:
        out["options"] = dict(args.options)
    if args.prefill_buckets is not None:
        out["prefill_buckets"] = args.prefill_buckets
    return out


def add_commands(sub: Any) -> None:
    p = sub.add_parser("generate", help="complete one prompt with a model, streaming to stdout")
    p.add_argument("prompt", nargs="?", default=None,
                   help="the prompt (a user message when the model has a chat template); '-' reads it from standard "
                        "input")
    p.add_argument("-f", "--file", metavar="PATH", default=None,
                   help="read the prompt from this file (UTF-8) instead of the command line")
    _engine_args(p)
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: text, token_ids, finish_reason, usage, seed")
    p.set_defaults(func=_cmd_generate, clean_json=True)

    p = sub.add_parser("chat", help="interactive chat with history (/help lists the commands, Ctrl-D quits)",
                       description=CHAT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _engine_args(p)
    p.add_argument("--system", default=None, help="a system message to start every conversation")
    p.set_defaults(func=_cmd_chat)


def _say(args: argparse.Namespace, level: int, text: str) -> None:
    """A status line on stderr when the verbosity is at least ``level`` (0: by default)."""
    if verbosity(args) >= level:
        print(text, file=sys.stderr, flush=True)


class _Progress:
    """Weight-loading progress on stderr: a bar on a terminal (erased when done), else
    a line with ``-v``; nothing with ``-q``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tty = sys.stderr.isatty() and verbosity(args) >= 0
        self.start = time.monotonic()
        self.last = 0.0
        self.announced = False

    def __call__(self, done: int, total: int, what: str = "") -> None:
        if not self.announced:
            self.announced = True
            if not self.tty:
                _say(self.args, 1, f"loading weights ({total} tensors)...")
        if not self.tty:
            return
        now = time.monotonic()
        if done < total and now - self.last < 0.05:
            return
        self.last = now
        width = 30
        fill = int(width * done / max(total, 1))
        print(f"\rloading weights [{'#' * fill}{'.' * (width - fill)}] {done}/{total} {what[:40]:<40}",
              end="", file=sys.stderr, flush=True)

    def done(self, model: Any) -> None:
        if self.tty and self.announced:
            print("\r" + " " * 100 + "\r", end="", file=sys.stderr)
        _say(self.args, 1, f"loaded {model!r} in {time.monotonic() - self.start:.1f}s")


def ready_line(model: Any, engine: Any, seconds: float) -> str:
    """The one line a command prints by default once the model is ready: which model,
    on which backend (for a backend that reports host-compiled kernels, their state and
    ISA path), and how long loading took. ``-v`` prints every speed path as well."""
    from polyengine.construction import speed_paths

    name = str(getattr(model, "source", "model")).split(" (", 1)[0]  # a hub or plugin name without its path
    if Path(name).exists():
        name = Path(name).name  # a file or folder: its name says enough
    if getattr(model, "is_random", False):
        name += " (random weights)"
    paths = speed_paths(engine)
    if "kernels" in paths:
        isa = paths.get("isa", "").split(" ")[0]
        compiled = paths["kernels"].startswith("compiled")
        detail = f"kernels: compiled{f' ({isa})' if isa else ''}" if compiled else "kernels: not used (-v says why)"
    else:
        detail = paths.get("device", "")
    return (f"{name} on {getattr(engine, 'name', '?')}{f' ({detail})' if detail else ''}, "
            f"ready in {seconds:.1f}s")


def _build(args: argparse.Namespace, *, needs_tokenizer: bool = True):
    from polyengine.cli_checks import check_before_loading
    from polyengine.driver import LLM
    from polyengine.models import load_model

    start = time.monotonic()
    # Flags, backend options, the context length and the tokenizer are checked before
    # the weights load: a mistake costs seconds, not a load.
    check_before_loading(args.model, backend=args.backend, options=dict(args.options),
                         context_length=args.context_length, needs_tokenizer=needs_tokenizer)
    progress = _Progress(args)
    model = load_model(args.model, progress=progress, exclusive=True,  # for this one engine (Model.exclusive)
                       download_progress=verbosity(args) >= 0)
    progress.done(model)
    # One prompt at a time: one slot. The context and dtype defaults are the engine's own.
    llm = LLM(model, args.backend, tools=not args.no_tools, max_slots=1, max_cache_length=args.context_length,
              dtype=args.dtype or None, **engine_config_kwargs(args))
    # With -v, the engine's startup log line listed what runs, each fallback with its fix.
    _say(args, 0, ready_line(model, llm.engine, time.monotonic() - start))
    return llm


def _sampling(args: argparse.Namespace):
    from polyengine.sampling import SamplingParams

    values: dict[str, Any] = {"max_tokens": args.max_tokens}
    for flag, field in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "seed")):
        val = getattr(args, flag)
        if val is not None:
            values[field] = val
    return SamplingParams.create(**values).with_seed()


def _prompt(args: argparse.Namespace) -> str:
    """The prompt from the command line, ``--file PATH`` or standard input (``-``)."""
    if args.file is not None:
        if args.prompt is not None:
            raise InvalidRequest(f"a prompt ({args.prompt[:40]!r}) and --file {args.file} were both given; pass one")
        from polyengine.files import open_regular

        def unreadable(msg: str) -> InvalidRequest:
            return InvalidRequest(f"--file {args.file}: {msg}")

        with open_regular(Path(args.file).expanduser(), what="prompt file", error=unreadable) as f:
            data = f.read(MAX_PROMPT_FILE_BYTES + 1)
        if len(data) > MAX_PROMPT_FILE_BYTES:
            raise InvalidRequest(f"--file {args.file} is larger than {MAX_PROMPT_FILE_BYTES // 2**20} MiB")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"--file {args.file} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if args.prompt is None:
        raise InvalidRequest("no prompt: pass it as an argument, '-' to read standard input, or --file PATH")
    if args.prompt == "-":  # as cat, sort and llama.cpp's -f - do: the prompt from standard input
        return sys.stdin.read()
    return args.prompt


def _cmd_generate(args: argparse.Namespace) -> int:
    args.prompt = _prompt(args)
    sampling = _sampling(args)
    llm = _build(args)
    tok = llm.tokenizer
    if args.raw or tok is None or not tok.chat_template:
        prompt: Any = args.prompt
    else:
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    if args.json:
        c = llm.generate([prompt], sampling)[0]
        out = getattr(args, "out", sys.stdout)
        json.dump(
            {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
             "usage": c.usage.to_dict(), "seed": c.seed},
            out, ensure_ascii=False,
        )
        out.write("\n")
        return 0
    for delta in llm.stream(prompt, sampling):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if sampling.temperature != 0:  # greedy output does not depend on the seed
        _say(args, 0, f"(seed {sampling.seed})")
    return 0


CHAT_HELP = """\
Chat with a model, keeping the conversation as its history.

Commands (a line that is only the command):
  /help    this list
  /reset   forget the conversation (the --system message stays)
  /exit    quit (also /quit, /bye, or Ctrl-D); Ctrl-C stops a reply
A message of several lines goes between two lines of three double quotes:
  \"\"\"
  first line
  second line
  \"\"\"
(the text may start on the opening line and end on the closing one: \"\"\"one
two\"\"\"). On a terminal, lines are edited with readline (arrows, Ctrl-R) and kept
in a private history file (mode 0600) under $XDG_STATE_HOME/polyengine (default
~/.local/state/polyengine/chat_history). With input piped in, nothing is echoed and
no history is kept."""

_QUOTES = '\"\"\"'
MAX_PROMPT_FILE_BYTES = 16 * 2**20  # far past any context; a bound on what --file reads into memory


def history_path() -> Path:
    """Where chat keeps the lines typed at a terminal: $XDG_STATE_HOME/polyengine/
    chat_history, else ~/.local/state/polyengine/chat_history (:func:`polyengine.cache.state_root`)."""
    from polyengine.cache import state_root

    return state_root() / "chat_history"


class ChatInput:
    """Where chat reads its lines: a terminal (readline editing and a private history
    file) or a pipe (plain reads, no prompt text, nothing kept). ``read`` returns one
    line without its newline, or None at end of input."""

    def __init__(self, tty: bool, history: Path | None = None):
        self.readline = None
        self.history = history
        if tty:
            try:
                import readline
            except ImportError:  # a Python built without it: plain input() still works
                readline = None
            self.readline = readline
        if self.readline is not None and history is not None:
            self._open_history()

    def _open_history(self) -> None:
        import os

        try:
            self.history.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.history, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
            os.fchmod(fd, 0o600)  # one made before, by another tool or umask, becomes private too
            os.close(fd)
            self.readline.read_history_file(str(self.history))
        except OSError as exc:
            print(f"polyengine: warning: chat history off ({self.history}: {exc.strerror or exc})", file=sys.stderr)
            self.history = None
            return
        self.readline.set_history_length(1000)

    def read(self, prompt: str) -> str | None:
        if self.readline is None:
            return _read_line("")
        try:
            line = input(prompt)
        except EOFError:
            return None
        if len(line) > MAX_CHAT_LINE_CHARS:
            raise InvalidRequest(f"the line is longer than {MAX_CHAT_LINE_CHARS:,} characters")
        return line

    def close(self) -> None:
        if self.readline is not None and self.history is not None:
            with contextlib.suppress(OSError):
                self.readline.write_history_file(str(self.history))


def read_message(lines: ChatInput) -> str | None:
    """One user message: a line, or the lines of a \"\"\" block (see CHAT_HELP)
    joined with newlines; None at end of input."""
    line = lines.read("you> ")
    if line is None or not line.lstrip().startswith(_QUOTES):
        return line
    text = line.lstrip()[len(_QUOTES):]
    if text.rstrip().endswith(_QUOTES):  # """one line"""
        return text.rstrip()[:-len(_QUOTES)]
    parts = [text] if text else []
    while (more := lines.read("... ")) is not None:
        if more.rstrip().endswith(_QUOTES):
            last = more.rstrip()[:-len(_QUOTES)]
            if last:
                parts.append(last)
            break
        parts.append(more)
    if sum(map(len, parts)) + len(parts) > MAX_CHAT_LINE_CHARS:
        raise InvalidRequest(f"the message is longer than {MAX_CHAT_LINE_CHARS:,} characters")
    return "\n".join(parts)


def _read_line(prompt: str) -> str | None:
    """One line typed by the user (without its newline), or None at end of input. A
    line longer than MAX_CHAT_LINE_CHARS is read to its end and refused."""
    sys.stdout.write(prompt)
    sys.stdout.flush()
    line = sys.stdin.readline(MAX_CHAT_LINE_CHARS + 1)
    if not line:
        return None
    if len(line) > MAX_CHAT_LINE_CHARS and not line.endswith("\n"):
        while (rest := sys.stdin.readline(1 << 16)) and not rest.endswith("\n"):
            pass
        raise InvalidRequest(f"the line is longer than {MAX_CHAT_LINE_CHARS:,} characters")
    return line.rstrip("\n")


def _cmd_chat(args: argparse.Namespace) -> int:
    sampling = _sampling(args)
    llm = _build(args)
    if llm.tokenizer is None or not llm.tokenizer.chat_template:
        raise InvalidRequest("this model has no chat template; use `polyengine generate --raw`")
    with contextlib.suppress(AttributeError, ValueError):
        # Undecodable bytes become lone surrogates, refused per line, instead of an
        # exception that would end the session.
        sys.stdin.reconfigure(errors="surrogateescape")
    tty = sys.stdin.isatty() and sys.stdout.isatty()
    lines = ChatInput(tty, history_path() if tty else None)
    try:
        return _chat_loop(args, llm, sampling, lines)
    finally:
        lines.close()


def _chat_loop(args: argparse.Namespace, llm: Any, sampling: Any, lines: ChatInput) -> int:
    base = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)
    _say(args, 0, "chat: /help lists the commands, /exit or Ctrl-D quits, Ctrl-C stops a reply")
    while True:
        try:
            line = read_message(lines)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        except InvalidRequest as exc:
            print(f"error: {exc}", file=sys.stderr)
            continue
        if line is None:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        command = line.strip()
        if command in ("/exit", "/quit", "/bye"):
            return 0
        if command == "/reset":
            history = list(base)
            print("(history cleared)", file=sys.stderr)
            continue
        if command in ("/help", "/?"):
            print(CHAT_HELP.partition("\n\n")[2], file=sys.stderr)
            continue
        if command.startswith("/") and " " not in command and len(command) < 32:
            print(f"error: unknown command {command} (/help lists them; a message starting with / goes "
                  f"in a \"\"\" block)", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        try:
            stream = llm.stream_chat(history, sampling.replace(seed=None).with_seed() if args.seed is None else sampling)
        except PolyengineError as exc:  # this turn failed; the session goes on
            history.pop()
            hint = " (if the conversation has grown too long, /reset clears it)" if len(history) > len(base) else ""
            print(f"error: {exc}{hint}", file=sys.stderr)
            continue
        reply = []
        sys.stdout.write("assistant> ")
        try:
            for delta in stream:
                reply.append(delta.text)
                sys.stdout.write(delta.text)
                sys.stdout.flush()
        except KeyboardInterrupt:
            stream.close()  # cancels the request and frees its slot
            sys.stdout.write(" [stopped]")
        except PolyengineError as exc:
            sys.stdout.write("\n")
            print(f"error: {exc}", file=sys.stderr)
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
