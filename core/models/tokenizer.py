"""The tokenizer: a ``tokenizers.Tokenizer`` plus the model's special tokens and chat template.

Built from an HF folder or from GGUF metadata by
:mod:`polyengine.models.tokenizer_files`, which validates and bounds every value
those files hold.

The contract is transformers' behaviour on the same files: ids from :meth:`encode`
equal ``AutoTokenizer`` ids (for a GGUF, ``AutoTokenizer.from_pretrained(dir,
gguf_file=...)``), and :meth:`decode` equals its ``decode``.

Text to encode is untrusted: :meth:`encode` refuses, before the tokenizer sees it,
anything but a ``str``, a string that is not valid Unicode (lone surrogates, which is
how Python carries undecodable bytes from a command line or a pipe), and a string over
:data:`~polyengine.limits.MAX_TEXT_CHARS` characters (or a caller's smaller bound):
the Rust tokenizer needs memory many times the text's size and aborts the process when
it cannot get it.

Decisions:
- Special-token strings inside text are matched as special tokens (transformers'
  default); ``add_special_tokens`` only controls BOS/EOS framing.
- ``eos_token_ids`` is EOS plus every known end-of-turn token (``<|im_end|>``,
  ``<|eot_id|>``, ...) that the chat template writes, plus GGUF's ``eot``/``eom`` ids.
- ``clean_up_tokenization_spaces`` is not applied: it would make decoded text differ
  from the concatenation of streamed pieces.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenizers import AddedToken, decoders, pre_tokenizers
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from polyengine.errors import ContextLengthExceeded, InvalidRequest
from polyengine.limits import MAX_TEXT_CHARS
from polyengine.models.chat import ChatTemplate, ChatTemplateError
from polyengine.models.tokenizer_files import BYTE_TO_UNICODE, gguf_tokenizer_parts, hf_tokenizer_parts
from polyengine.validation import check_text

__all__ = ["Tokenizer", "IncrementalDetokenizer", "END_OF_TURN_TOKENS", "BYTE_TO_UNICODE", "byte_level_tokenizer",
           "check_text"]

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

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")




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

        return cls(**hf_tokenizer_parts(Path(folder)))

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any], *, source: str = "<gguf>") -> "Tokenizer":
        """From a GGUF's ``tokenizer.ggml.*`` metadata (``gpt2`` BPE or ``llama`` SentencePiece)."""

        return cls(**gguf_tokenizer_parts(metadata, source))

    # -- the API the driver uses ------------------------------------------------------------

    @property
    def backend(self) -> _Backend:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False, max_chars: int | None = None,
               what: str = "prompt") -> list[int]:
        """Token ids of ``text``; special-token strings in it become special tokens.
        ``add_special_tokens`` adds the model's framing (BOS when :attr:`add_bos`).
        Text that is not a valid Unicode string, or longer than ``max_chars`` (at most
        :data:`MAX_TEXT_CHARS`), is refused first (:func:`check_text`; ``what`` names it)."""
        check_text(text, what, max_chars=max_chars)
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

