"""The tokenizer: a ``tokenizers.Tokenizer`` plus the model's special tokens and chat template.

Built from an HF folder (``tokenizer.json`` with ``tokenizer_config.json`` /
``special_tokens_map.json`` / ``chat_template.jinja``) or from GGUF metadata, whose
vocabulary, merges and token types are turned back into a ``tokenizers`` pipeline.

The contract is transformers' behaviour on the same files: ids from :meth:`encode`
equal ``AutoTokenizer`` ids (for a GGUF, ``AutoTokenizer.from_pretrained(dir,
gguf_file=...)``), and :meth:`decode` equals its ``decode``.

Decisions:
- Special-token strings inside text are matched as special tokens (transformers'
  default); ``add_special_tokens`` only controls BOS/EOS framing.
- GGUF ``gpt2`` (byte-level BPE) vocabularies: the split regex is chosen by
  ``tokenizer.ggml.pre`` for the names transformers knows (Llama 3, Qwen2, GPT-4o,
  Tekken families); every other name, SmolLM2's ``smollm`` included, gets GPT-2's
  regex as in transformers (llama.cpp would first split digits apart for ``smollm``;
  see ``_PRE_SPLITS``). Control tokens become special added tokens, user-defined ones
  plain added tokens.
- GGUF ``llama`` (SentencePiece) vocabularies become a byte-fallback BPE whose merges are
  derived from the piece scores, with a Metaspace pre-tokenizer that prepends ``▁`` to
  the first word: transformers' conversion (it ignores ``add_space_prefix``, so do we).
- BOS/EOS framing of an HF folder is ``tokenizer.json``'s post-processor;
  ``tokenizer_config.json``'s ``add_bos_token``/``add_eos_token`` are ignored when a
  ``tokenizer.json`` exists, as transformers v5 ignores them.
- ``eos_token_ids`` is EOS plus every known end-of-turn token (``<|im_end|>``,
  ``<|eot_id|>``, ...) that the chat template writes, plus GGUF's ``eot``/``eom`` ids.
- ``clean_up_tokenization_spaces`` is not applied: it would make decoded text differ
  from the concatenation of streamed pieces.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from polyengine.errors import ModelConfigError

__all__ = ["Tokenizer", "IncrementalDetokenizer", "END_OF_TURN_TOKENS"]

log = logging.getLogger(__name__)

# Tokens that end an assistant turn in common chat templates.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|assistant_end|>",
    "<|end_of_turn|>",
)
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")

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


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template."""

    def __init__(
        self,
        backend: _Backend,
        *,
        special_tokens: dict[str, str] | None = None,
        chat_template: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        source: str = "<memory>",
    ):
        self._tok = backend
        self.source = source
        named = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.special_tokens_map: dict[str, str] = named
        # Named specials the backend lacks as added tokens are added (transformers does too),
        # so that they are matched whole in text.
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = [v for v in dict.fromkeys(named.values()) if v not in added]
        if missing:
            backend.add_special_tokens([AddedToken(v, special=True, normalized=False) for v in missing])
        self.chat_template = chat_template
        self.bos_token_id = self.token_to_id(named["bos_token"]) if "bos_token" in named else None
        eos: list[int] = []
        if "eos_token" in named and self.token_to_id(named["eos_token"]) is not None:
            eos.append(self.token_to_id(named["eos_token"]))
        eos += list(extra_eos_ids)
        for tok in END_OF_TURN_TOKENS:
            tid = self.token_to_id(tok)
            if tid is not None and chat_template and tok in chat_template:
                eos.append(tid)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        framed = backend.encode("", add_special_tokens=True).ids
        self.add_bos: bool = self.bos_token_id is not None and framed[:1] == [self.bos_token_id]
        self._template = None
        self._byte_fallback_ids: frozenset[int] | None = None

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "Tokenizer":
        """From an HF folder: ``tokenizer.json`` plus the optional config files."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        try:
            backend = _Backend.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise ModelConfigError(f"{path}: cannot load tokenizer: {exc}") from None
        config = _json_or_empty(folder / "tokenizer_config.json")
        specials_map = _json_or_empty(folder / "special_tokens_map.json")
        specials = {k: _token_str(specials_map.get(k)) for k in _NAMED_SPECIALS}
        specials.update({k: _token_str(config[k]) for k in _NAMED_SPECIALS if k in config})
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        else:
            template = _pick_template(config.get("chat_template"))
        return cls(backend, special_tokens=specials, chat_template=template, source=str(folder))

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any], *, source: str = "<gguf>") -> "Tokenizer":
        """From a GGUF's ``tokenizer.ggml.*`` metadata (``gpt2`` BPE or ``llama`` SentencePiece)."""
        kind = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelConfigError(f"{source}: GGUF has no tokenizer.ggml.tokens; cannot build a tokenizer")
        types = list(metadata.get("tokenizer.ggml.token_type") or [])
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, metadata.get("tokenizer.ggml.merges") or [], metadata.get("tokenizer.ggml.pre"), source)
            add_bos_default = False
        elif kind == "llama":
            scores = metadata.get("tokenizer.ggml.scores")
            if scores is None:
                raise ModelConfigError(f"{source}: SentencePiece GGUF vocabulary has no tokenizer.ggml.scores")
            backend = _sentencepiece_bpe(tokens, list(scores))
            add_bos_default = True
        else:
            raise ModelConfigError(
                f"{source}: GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE), "
                "llama (SentencePiece BPE)"
            )
        alphabet = set(BYTE_TO_UNICODE.values()) if kind == "gpt2" else None
        control, user = [], []
        for tok, typ in zip(tokens, types):
            if typ == _CONTROL and (alphabet is None or set(tok) <= alphabet):
                control.append(AddedToken(tok, special=True, normalized=False))
            elif typ == _USER_DEFINED:
                user.append(AddedToken(tok, special=False, normalized=False))
        if control:
            backend.add_special_tokens(control)
        if user:
            backend.add_tokens([t for t in user if backend.token_to_id(t.content) is not None])

        def tok_of(key: str) -> str | None:
            i = metadata.get(f"tokenizer.ggml.{key}_token_id")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        specials = {
            "bos_token": tok_of("bos"),
            "eos_token": tok_of("eos"),
            "unk_token": tok_of("unknown"),
            "pad_token": tok_of("padding"),
        }
        _set_framing(
            backend,
            specials["bos_token"],
            specials["eos_token"],
            bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        )
        extra = [metadata[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in metadata]
        return cls(
            backend,
            special_tokens=specials,
            chat_template=metadata.get("tokenizer.chat_template"),
            extra_eos_ids=[int(i) for i in extra],
            source=source,
        )

    # -- the API the driver uses ------------------------------------------------------------

    @property
    def backend(self) -> _Backend:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it become special tokens.
        ``add_special_tokens`` adds the model's framing (BOS when :attr:`add_bos`)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` with the model's own template, as transformers'
        ``apply_chat_template(..., tokenize=False)`` does."""
        from polyengine.models.chat import ChatTemplate, ChatTemplateError

        if self.chat_template is None:
            raise ChatTemplateError(f"tokenizer from {self.source} has no chat template")
        if self._template is None:
            self._template = ChatTemplate(self.chat_template)
        return self._template.render(
            messages, add_generation_prompt=add_generation_prompt, special_tokens=self.special_tokens_map, **kwargs
        )

    def detokenizer(self, prompt_ids: Sequence[int] = ()) -> "IncrementalDetokenizer":
        """A streaming decoder for one completion (``prompt_ids``: its prompt, as context)."""
        return IncrementalDetokenizer(self, prompt_ids)

    @property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of ``<0xNN>`` byte tokens when the decoder uses ByteFallback (else empty)."""
        if self._byte_fallback_ids is None:
            ids: frozenset[int] = frozenset()
            if "ByteFallback" in repr(self._tok.decoder):
                ids = frozenset(i for t, i in self._tok.get_vocab().items() if _BYTE_PIECE.fullmatch(t))
            self._byte_fallback_ids = ids
        return self._byte_fallback_ids

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_ids})"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces without ever cutting a character.

    Each :meth:`push` decodes a short window: the tokens of the last emitted piece (the
    "prefix", kept so that decoders which treat a sequence's start specially, like
    SentencePiece's leading-space strip, see the same context) plus the new ones, and
    emits what the window adds beyond the prefix. While that text ends in U+FFFD the
    tokens hold an unfinished UTF-8 character, so nothing is emitted yet. SentencePiece
    byte-fallback tokens (``<0xE6>``) are also held until a normal token ends their run:
    the ByteFallback decoder turns a whole run into U+FFFDs when any byte in it is
    invalid, so a character decoded early could be taken back.

    Without ``prompt_ids`` the pieces concatenate (with :meth:`flush`) to
    ``decode(all pushed ids)``. With them, the last few prompt tokens seed the prefix,
    so pieces are what the completion adds to the decoded prompt (a SentencePiece
    leading space is kept); for byte-level vocabularies that is the same text.
    """

    _CONTEXT = 4  # prompt tokens used as context: enough for any decoder's look-behind

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        context = [int(i) for i in prompt_ids[-self._CONTEXT :]]
        # A prompt ending mid-character would make its decode unstable as a prefix.
        if context and (tokenizer.decode(context).endswith("\ufffd") or context[-1] in tokenizer.byte_fallback_ids):
            context = []
        self._ids: list[int] = context
        self._prefix = 0  # window start
        self._read = len(context)  # ids before this are already emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (maybe "")."""
        self._ids.append(int(token_id))
        if int(token_id) in self._tokenizer.byte_fallback_ids:
            return ""
        prev = self._tokenizer.decode(self._ids[self._prefix : self._read])
        text = self._tokenizer.decode(self._ids[self._prefix :])
        if text.endswith("\ufffd") or not text.startswith(prev):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prev) :]

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character decodes as U+FFFD)."""
        prev = self._tokenizer.decode(self._ids[self._prefix : self._read])
        text = self._tokenizer.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        if text.startswith(prev):
            return text[len(prev) :]
        return text  # pragma: no cover - decoders seen so far keep prefixes stable


# -- builders ------------------------------------------------------------------------------


def byte_level_tokenizer(specials: Sequence[str]) -> _Backend:
    """A 256-token byte-level tokenizer (no merges) plus ``specials`` as special tokens.

    Used by the random-weight presets: any text round-trips, and ids 0..255 are bytes.
    """
    vocab = {BYTE_TO_UNICODE[b]: b for b in range(256)}
    backend = _Backend(BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return backend


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None, source: str) -> _Backend:
    alphabet = set(BYTE_TO_UNICODE.values())
    # A token spelled outside the byte alphabet could never be produced by the BPE;
    # respell it as bytes so it is reachable (transformers does the same).
    vocab = {
        (t if set(t) <= alphabet else "".join(BYTE_TO_UNICODE[b] for b in t.encode("utf-8"))): i
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


def _sentencepiece_bpe(tokens: list[str], scores: list[float]) -> _Backend:
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = _Backend(
        BPE(vocab=vocab, merges=_merges_from_scores(tokens, scores, vocab), fuse_unk=True, byte_fallback=True, dropout=None)
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece keeps no merge list: every split of a piece into two known pieces is a
    merge, ranked by the merged piece's score (best first), ties by the left piece's length
    then the right's (longer first), then file order."""
    score_of = dict(zip(tokens, scores))
    found = []
    for piece, score in score_of.items():
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found.extend((score, len(l), len(r), l, r) for l, r in local)
    order = sorted(range(len(found)), key=lambda i: found[i][:3], reverse=True)
    # sorted(reverse=True) keeps equal keys in their original order, which is what we want.
    return [(found[i][3], found[i][4]) for i in order]


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


def _json_or_empty(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"{path}: cannot read: {exc}") from None
    return data if isinstance(data, dict) else {}


def _token_str(value: Any) -> str | None:
    """A special token as tokenizer_config spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    """``chat_template`` is a string, or a list of ``{name, template}`` (take "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None
