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
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no loading lines, speed-path report or seed on stderr (errors and warnings still show)")
    add_engine_config_args(p)


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
    p.add_argument("prompt", help="the prompt (a user message when the model has a chat template); '-' reads it "
                                  "from standard input")
    _engine_args(p)
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: text, token_ids, finish_reason, usage, seed")
    p.set_defaults(func=_cmd_generate, clean_json=True)

    p = sub.add_parser("chat", help="interactive chat with history (/reset clears it, Ctrl-D quits)")
    _engine_args(p)
    p.add_argument("--system", default=None, help="a system message to start every conversation")
    p.set_defaults(func=_cmd_chat)


class _Progress:
    """Weight-loading progress on stderr: a bar on a terminal, two lines otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.start = time.monotonic()
        self.last = 0.0
        self.announced = False

    def __call__(self, done: int, total: int, what: str = "") -> None:
        if not self.announced:
            self.announced = True
            if not self.tty:
                print(f"loading weights ({total} tensors)...", file=sys.stderr, flush=True)
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
        print(f"loaded {model!r} in {time.monotonic() - self.start:.1f}s", file=sys.stderr, flush=True)


def _build(args: argparse.Namespace):
    from polyengine.driver import LLM
    from polyengine.models import load_model

    from polyengine.selection import select_backend

    if args.context_length is not None and args.context_length < 2:
        raise InvalidRequest(f"--context-length must be at least 2 (prompt + completion tokens), got {args.context_length}")
    select_backend(args.backend)  # an unknown or unavailable backend is reported before loading weights
    progress = None if args.quiet else _Progress()
    model = load_model(args.model, progress=progress, exclusive=True,  # for this one engine (Model.exclusive)
                       download_progress=not args.quiet)
    if progress is not None:
        progress.done(model)
    # One prompt at a time: one slot. The context and dtype defaults are the engine's own.
    llm = LLM(model, args.backend, tools=not args.no_tools, max_slots=1, max_cache_length=args.context_length,
              dtype=args.dtype or None, **engine_config_kwargs(args))
    from polyengine.construction import speed_paths

    if args.quiet:
        return llm
    # What runs, each fallback with its fix: the same words as the engine's startup log line.
    print(f"backend: {llm.engine.name}", file=sys.stderr)
    for key, value in speed_paths(llm.engine).items():
        print(f"  {key}: {value}", file=sys.stderr)
    sys.stderr.flush()
    return llm


def _sampling(args: argparse.Namespace):
    from polyengine.sampling import SamplingParams

    values: dict[str, Any] = {"max_tokens": args.max_tokens}
    for flag, field in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "seed")):
        val = getattr(args, flag)
        if val is not None:
            values[field] = val
    return SamplingParams.create(**values).with_seed()


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.prompt == "-":  # as cat, sort and llama.cpp's -f - do: the prompt from standard input
        args.prompt = sys.stdin.read()
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
    if not args.quiet and sampling.temperature != 0:  # greedy output does not depend on the seed
        print(f"(seed {sampling.seed})", file=sys.stderr)
    return 0


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
    base = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)
    if not args.quiet:
        print("chat: /reset clears the history, /exit or Ctrl-D quits, Ctrl-C stops a reply", file=sys.stderr)
    while True:
        try:
            line = _read_line("you> " if sys.stdin.isatty() else "")  # no prompt text when input is piped
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
        if line.strip() in ("/exit", "/quit", "/bye"):
            return 0
        if line.strip() == "/reset":
            history = list(base)
            print("(history cleared)", file=sys.stderr)
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
