"""Building a :class:`~polyengine.models.tokenizer.Tokenizer` from a model's files: an
HF folder (``tokenizer.json`` with ``tokenizer_config.json`` /
``special_tokens_map.json`` / ``chat_template.jinja``) or GGUF metadata, whose
vocabulary, merges and token types are turned back into a ``tokenizers`` pipeline.

Every value is read through :class:`~polyengine.models.metadata.Fields` and bounded by
:mod:`polyengine.limits` before it is used: the vocabulary is a list of strings of at
most ``MAX_TOKEN_CHARS`` characters, token types and scores are as many as the tokens,
special token ids lie inside the vocabulary, flags are booleans, the chat template is a
string of at most ``MAX_TEMPLATE_BYTES``, JSON files are size- and depth-bounded, and a
SentencePiece vocabulary whose merge derivation would take more than
``MAX_SENTENCEPIECE_SPLITS`` steps is refused. A bad value is a
:class:`ModelConfigError` naming the file and the key.

Decisions:
- GGUF ``gpt2`` (byte-level BPE) vocabularies: the split regex is chosen by
  ``tokenizer.ggml.pre`` for the names transformers knows (Llama 3, Qwen2, GPT-4o,
  Tekken families); every other name, SmolLM2's ``smollm`` included, gets GPT-2's
  regex as in transformers (llama.cpp would first split digits apart for ``smollm``;
  see ``_PRE_SPLITS``). Control tokens become special added tokens, user-defined ones
  plain added tokens.
- GGUF ``llama`` (SentencePiece) vocabularies become a byte-fallback BPE whose merges are
  derived from the piece scores, with a Metaspace pre-tokenizer that prepends ``▁`` to
  the first word: transformers' conversion (it ignores ``add_space_prefix``, so do we),
  except for Gemma's vocabularies, which transformers converts without that prefix.
- BOS/EOS framing of an HF folder is ``tokenizer.json``'s post-processor;
  ``tokenizer_config.json``'s ``add_bos_token``/``add_eos_token`` are ignored when a
  ``tokenizer.json`` exists, as transformers v5 ignores them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from polyengine.errors import ModelConfigError
from polyengine.files import read_regular
from polyengine.limits import (
    MAX_SENTENCEPIECE_SPLITS,
    MAX_TEMPLATE_BYTES,
    MAX_TOKEN_CHARS,
    MAX_TOKENIZER_JSON_BYTES,
    MAX_VOCAB,
)
from polyengine.models.metadata import Fields, read_json, shown
from polyengine.models.sp_merges import merges_from_scores

__all__ = ["gguf_tokenizer_parts", "hf_tokenizer_parts", "BYTE_TO_UNICODE"]

log = logging.getLogger(__name__)

_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regex text is split by before BPE. Every other name gets
# GPT-2's regex, as in transformers. That includes "smollm" (SmolLM2) and the StarCoder
# family, which llama.cpp and the original tokenizer.json split digit by digit first:
# the two differ only on a whitespace run right before a digit ("\t\t4": llama.cpp
# "\t\t","4"; transformers "\t","\t","4"). transformers is this module's contract.
_PRE_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano",
         "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}



# -- HF folders ---------------------------------------------------------------------------



def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (byte-level BPE's alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE = _bytes_to_unicode()
_DROP_ALPHABET = dict.fromkeys(map(ord, BYTE_TO_UNICODE.values()))


def _in_alphabet(token: str) -> bool:
    """Whether every character of ``token`` is in byte-level BPE's alphabet: deleting them
    leaves nothing (one C call; a vocabulary's spelling is checked on every load)."""
    return not token.translate(_DROP_ALPHABET)

def hf_tokenizer_parts(folder: Path) -> dict[str, Any]:
    """The :class:`Tokenizer` arguments for an HF folder's tokenizer files."""
    path = folder / "tokenizer.json"
    raw = read_regular(path, limit=MAX_TOKENIZER_JSON_BYTES, what="tokenizer",
                       error=lambda msg: ModelConfigError(f"{path}: {msg}"))
    try:
        backend = _Backend.from_str(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ModelConfigError(f"{path}: the tokenizer is not UTF-8 text (byte {exc.start}); the file is corrupt") from None
    except Exception as exc:  # tokenizers raises plain Exception subclasses
        raise ModelConfigError(f"{path}: cannot load tokenizer: {exc}") from None
    config = _json_object(folder / "tokenizer_config.json")
    specials_map = _json_object(folder / "special_tokens_map.json")
    specials = {k: _token_str(specials_map, k, folder / "special_tokens_map.json") for k in _NAMED_SPECIALS}
    specials.update({k: _token_str(config, k, folder / "tokenizer_config.json") for k in _NAMED_SPECIALS if k in config})
    template_file = folder / "chat_template.jinja"
    if template_file.exists():  # present but not a plain file is refused, not ignored
        template = _template_file(template_file)
    else:
        template = _pick_template(config.get("chat_template"), folder / "tokenizer_config.json")
    return dict(backend=backend, special_tokens=specials, chat_template=template, source=str(folder))


def _json_object(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = read_json(path, what="tokenizer configuration")
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_str(data: dict[str, Any], key: str, path: Path) -> str | None:
    """A special token as tokenizer_config spells it: a string, or an AddedToken object
    with a string ``content``; absent or null is None."""
    value = data.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ModelConfigError(f"{path}: {key} must be a string or an object with a string 'content'; "
                               f"got {shown(data.get(key))}")
    return value


def _template_file(path: Path) -> str:
    raw = read_regular(path, limit=MAX_TEMPLATE_BYTES, what="chat template",
                       error=lambda msg: ModelConfigError(f"{path}: {msg}"))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelConfigError(f"{path}: the chat template is not UTF-8 text (byte {exc.start})") from None


def _pick_template(value: Any, path: Path) -> str | None:
    """``chat_template`` is a string, or a list of ``{name, template}`` (take "default")."""
    form = "a string, or a list of {name, template} objects with string templates"
    if value is None:
        return None
    if isinstance(value, str):
        return check_template_size(value, f"{path}: chat_template")
    if not isinstance(value, list) or not all(
        isinstance(t, dict) and isinstance(t.get("template"), str) for t in value
    ):
        raise ModelConfigError(f"{path}: chat_template must be {form}; got {shown(value)}")
    named = {t.get("name"): t["template"] for t in value}
    chosen = named.get("default") or next(iter(named.values()), None)
    return None if chosen is None else check_template_size(chosen, f"{path}: chat_template")


def check_template_size(template: str, what: str) -> str:
    if len(template) > MAX_TEMPLATE_BYTES:
        raise ModelConfigError(f"{what}: the chat template has {len(template):,} characters; at most "
                               f"{MAX_TEMPLATE_BYTES // 1024:,} KiB is accepted (real ones are under 64 KiB)")
    return template


# -- GGUF metadata --------------------------------------------------------------------------


def gguf_tokenizer_parts(metadata: dict[str, Any], source: str) -> dict[str, Any]:
    """The :class:`Tokenizer` arguments for a GGUF's ``tokenizer.ggml.*`` metadata
    (``gpt2`` BPE or ``llama`` SentencePiece), every value validated first."""
    f = Fields(metadata, source)
    t = "tokenizer.ggml."
    kind = f.string(t + "model", None)
    if not f.has(t + "tokens"):
        raise ModelConfigError(f"{source}: GGUF has no tokenizer.ggml.tokens; cannot build a tokenizer")
    tokens = f.strings(t + "tokens", max_chars=MAX_TOKEN_CHARS)
    if not tokens or len(tokens) > MAX_VOCAB:
        raise f.fail(t + "tokens", f"a list of 1 to {MAX_VOCAB:,} strings", tokens)
    n = len(tokens)
    types = f.integers(t + "token_type", [])
    if types and len(types) != n:
        raise f.fail(t + "token_type", f"a list of integers, one per token ({n:,})", types)
    if kind == "gpt2":
        merges = f.strings(t + "merges", [])
        backend = _byte_level_bpe(tokens, merges, f.string(t + "pre", None), source)
        add_bos_default = False
    elif kind == "llama":
        if not f.has(t + "scores"):
            raise ModelConfigError(f"{source}: SentencePiece GGUF vocabulary has no tokenizer.ggml.scores")
        scores = f.numbers(t + "scores")
        if len(scores) != n:
            raise f.fail(t + "scores", f"a list of finite numbers, one per token ({n:,})", scores)
        splits = sum(len(tok) - 1 for tok in tokens if tok)
        if splits > MAX_SENTENCEPIECE_SPLITS:
            raise ModelConfigError(
                f"{source}: tokenizer.ggml.tokens: deriving SentencePiece merges would examine {splits:,} splits "
                f"(the pieces hold too many characters); at most {MAX_SENTENCEPIECE_SPLITS:,} are accepted"
            )
        # transformers converts Gemma's SentencePiece vocabularies without the dummy prefix.
        backend = _sentencepiece_bpe(tokens, scores, prefix=metadata.get("general.architecture") not in _NO_PREFIX)
        add_bos_default = True
    else:
        raise ModelConfigError(
            f"{source}: GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE), "
            "llama (SentencePiece BPE)"
        )
    control, user = [], []
    for tok, typ in zip(tokens, types):
        if typ == _CONTROL and (kind != "gpt2" or _in_alphabet(tok)):
            control.append(AddedToken(tok, special=True, normalized=False))
        elif typ == _USER_DEFINED:
            user.append(AddedToken(tok, special=False, normalized=False))
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens([u for u in user if backend.token_to_id(u.content) is not None])

    def tok_of(key: str) -> str | None:
        i = f.integer(f"{t}{key}_token_id", None, min=0, max=n - 1)
        return None if i is None else tokens[i]

    specials = {"bos_token": tok_of("bos"), "eos_token": tok_of("eos"), "unk_token": tok_of("unknown"),
                "pad_token": tok_of("padding")}
    _set_framing(backend, specials["bos_token"], specials["eos_token"],
                 f.boolean(t + "add_bos_token", add_bos_default), f.boolean(t + "add_eos_token", False))
    extra = [i for k in ("eot", "eom") if (i := f.integer(f"{t}{k}_token_id", None, min=0, max=n - 1)) is not None]
    template = f.string("tokenizer.chat_template", None)
    return dict(
        backend=backend,
        special_tokens=specials,
        chat_template=None if template is None else check_template_size(template, f"{source}: tokenizer.chat_template"),
        extra_eos_ids=extra,
        source=source,
    )


# -- pipelines ------------------------------------------------------------------------------


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None, source: str) -> _Backend:
    # A token spelled outside the byte alphabet could never be produced by the BPE;
    # respell it as bytes so it is reachable (transformers does the same).
    vocab = {
        (t if _in_alphabet(t) else "".join(BYTE_TO_UNICODE[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ModelConfigError(f"{source}: malformed merge {m!r} in tokenizer.ggml.merges")
        pairs.append((parts[0], parts[1]))
    backend = _Backend(
        BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    split = _PRE_SPLITS.get(pre)
    if split is None:
        log.debug("%s: GGUF pre-tokenizer %r: splitting text with GPT-2's regex", source, pre)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


_NO_PREFIX = ("gemma", "gemma2", "gemma3")


def _sentencepiece_bpe(tokens: list[str], scores: list[float], *, prefix: bool = True) -> _Backend:
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = _Backend(
        BPE(vocab=vocab, merges=merges_from_scores(tokens, scores), fuse_unk=True, byte_fallback=True, dropout=None)
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                     split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    return backend


def _set_framing(backend: _Backend, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool) -> None:
    add_bos = add_bos and bos is not None and backend.token_to_id(bos) is not None
    add_eos = add_eos and eos is not None and backend.token_to_id(eos) is not None
    single = (f"{bos}:0 " if add_bos else "") + "$A:0" + (f" {eos}:0" if add_eos else "")
    pair = single + (f" {bos}:1" if add_bos else "") + " $B:1" + (f" {eos}:1" if add_eos else "")
    special = []
    if add_bos:
        special.append((bos, backend.token_to_id(bos)))
    if add_eos and eos != bos:
        special.append((eos, backend.token_to_id(eos)))
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


