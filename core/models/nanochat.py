"""nanochat's GPT: its checkpoint folder to a :class:`Model`, without torch or unpickling.

The architecture is nanochat's first release (the seed's ``nanochat/gpt.py``): token
embedding, then an RMSNorm; per block ``x + attn(norm(x))`` and ``x + mlp(norm(x))``
with parameter-free RMSNorms (eps: float32's machine epsilon, what ``F.rms_norm``
uses in float32), rotary embeddings on q and k followed by a parameter-free per-head
QK norm, GQA, a squared-ReLU MLP of width ``4 * n_embd``, no biases; a final
parameter-free norm, an untied LM head and ``15 * tanh(logits / 15)``. Its rotary
convention rotates by ``-angle`` (``y1 = x1 cos + x2 sin``): that is the rotate-half
RoPE with negated frequencies, which is how :meth:`ModelConfig.rope_inv_freq` gives it
(so K in a cache is still "after RoPE, rotate-half"). Later nanochat models add value
embeddings, per-layer residual scalars, a smear gate and sliding windows: their
checkpoints are refused by name.

A checkpoint folder holds ``model_<step>.pt`` (a ``torch.save``'d state dict),
``meta_<step>.json`` (``model_config``: ``sequence_len``, ``vocab_size``, ``n_layer``,
``n_head``, ``n_kv_head``, ``n_embd``) and, copied beside them, nanochat's
``tokenizer.pkl`` (a pickled tiktoken encoding); the highest step is loaded.

Decisions:
- The core never imports torch, and nothing read from disk is unpickled freely: the
  ``.pt`` zip is read by :func:`read_torch_state_dict`, an unpickler that resolves only
  the globals a tensor state dict needs (``OrderedDict``, ``torch._utils._rebuild_tensor_v2``,
  the storage types) to stand-ins of its own, as ``torch.load(weights_only=True)``
  restricts them; anything else is a :class:`WeightsError`. ``tokenizer.pkl`` is read
  the same way with one allowed global, tiktoken's ``Encoding``, replaced by a record of
  its state (name, split pattern, ranks, special tokens); no tiktoken code runs.
- The tokenizer becomes a ``tokenizers`` byte-level BPE with nanochat's split pattern;
  the merges are recovered from the ranks (each token's merge is the split that a BPE
  limited to lower ranks reaches), the standard tiktoken conversion.
- The chat template is nanochat's conversation format (``<|bos|>``, user and assistant
  turns, a system message merged into the first user turn); ``<|assistant_end|>`` and
  ``<|bos|>`` end a completion (as nanochat's engine stops), and its tool tokens make the
  calculator tool work.
"""

from __future__ import annotations

import io
import pickle
import re
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import numpy as np

from polyengine.errors import ModelConfigError, WeightsError
from polyengine.limits import MAX_HEADS, MAX_HIDDEN, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB
from polyengine.models.metadata import Fields, read_json, require_finite, shown
from polyengine.models.presets import TEMPLATE_TAIL

__all__ = ["nanochat_features", "is_nanochat_folder", "load_nanochat", "read_torch_state_dict", "read_tiktoken_pickle",
           "NANOCHAT_SPECIALS", "NANOCHAT_TEMPLATE", "nanochat_weights"]

# nanochat's special tokens (its tokenizer.py), in its id order after the ranks.
NANOCHAT_SPECIALS = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
                     "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>")

NANOCHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}"
    "{% elif message['role'] == 'user' %}<|user_start|>{{ ns.system }}{{ message['content'] }}<|user_end|>"
    "{% set ns.system = '' %}"
) + TEMPLATE_TAIL

_LATER_PARTS = ("value_embeds", "resid_lambdas", "x0_lambdas", "smear", "backout", "ve_gate")
_STEP = re.compile(r"^model_(\d+)\.pt$")


def nanochat_features() -> dict[str, Any]:
    """The ModelConfig fields every nanochat GPT shares (its sizes come from its metadata):
    its row of the architecture table."""
    from polyengine.models.architectures import NANOCHAT_FEATURES

    return dict(NANOCHAT_FEATURES)


def is_nanochat_folder(path: Path) -> bool:
    return path.is_dir() and any(_STEP.match(p.name) for p in path.glob("model_*.pt"))


def _latest(folder: Path) -> tuple[Path, Path]:
    steps = sorted((int(m.group(1)), p) for p in folder.glob("model_*.pt") if (m := _STEP.match(p.name)))
    step, model = steps[-1]
    meta = folder / f"meta_{step:06d}.json"
    if not meta.is_file():
        raise ModelConfigError(f"{folder}: {model.name} has no {meta.name} beside it (nanochat writes both)")
    return model, meta


def nanochat_config(meta_path: Path, *, eos: tuple[int, ...] = (), bos: int | None = None):
    """The ModelConfig of a nanochat ``meta_<step>.json``."""
    from polyengine.models.config_files import build_config

    meta = read_json(meta_path, what="nanochat metadata")
    if not isinstance(meta, dict):
        raise ModelConfigError(f"{meta_path}: expected a JSON object")
    f = Fields(Fields(meta, str(meta_path)).mapping("model_config"), str(meta_path), prefix="model_config.")
    extra = sorted(set(f.data) - {"sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd"})
    if extra:
        raise ModelConfigError(f"{meta_path}: model_config has {extra}: a later nanochat architecture than the one "
                               f"supported (nanochat's first GPT: no sliding windows, value embeddings or per-layer "
                               f"scalars)")
    hidden = f.integer("n_embd", min=1, max=MAX_HIDDEN)
    heads = f.integer("n_head", min=1, max=MAX_HEADS)
    if hidden % heads:
        raise ModelConfigError(f"{meta_path}: n_embd ({hidden}) must be a multiple of n_head ({heads})")
    values = dict(
        model_type="nanochat", vocab_size=f.integer("vocab_size", min=1, max=MAX_VOCAB), hidden_size=hidden,
        intermediate_size=4 * hidden, num_hidden_layers=f.integer("n_layer", min=1, max=MAX_LAYERS),
        num_attention_heads=heads, num_key_value_heads=f.integer("n_kv_head", heads, min=1, max=heads),
        head_dim=hidden // heads, max_position_embeddings=f.integer("sequence_len", min=1, max=MAX_POSITIONS),
        bos_token_id=bos, eos_token_ids=eos, **nanochat_features(),
    )
    return build_config(values, str(meta_path))


def nanochat_weights(state: dict[str, np.ndarray], config, *, source: str) -> dict[str, np.ndarray]:
    """nanochat's parameter names to the HF names of :meth:`ModelConfig.weight_shapes`
    (``c_q`` -> ``q_proj``, ``mlp.c_fc`` -> ``mlp.up_proj``, ...)."""
    out: dict[str, np.ndarray] = {}
    layer = re.compile(r"^transformer\.h\.(\d+)\.(attn\.c_q|attn\.c_k|attn\.c_v|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)"
                       r"\.weight$")
    names = {"attn.c_q": "self_attn.q_proj", "attn.c_k": "self_attn.k_proj", "attn.c_v": "self_attn.v_proj",
             "attn.c_proj": "self_attn.o_proj", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
    for raw, arr in state.items():
        name = raw[len("_orig_mod."):] if raw.startswith("_orig_mod.") else raw  # torch.compile's prefix
        if any(part in name for part in _LATER_PARTS):
            raise WeightsError("a later nanochat architecture (value embeddings, per-layer scalars, smear gate); "
                               "only nanochat's first GPT is supported", file=source, tensor=raw)
        m = layer.match(name)
        if name == "transformer.wte.weight":
            out["model.embed_tokens.weight"] = arr
        elif name == "lm_head.weight":
            out["lm_head.weight"] = arr
        elif m:
            out[f"model.layers.{m.group(1)}.{names[m.group(2)]}.weight"] = arr
        else:
            raise WeightsError("not a nanochat GPT parameter", file=source, tensor=raw)
    expected = config.weight_shapes()
    for name, shape in expected.items():
        if name not in out:
            raise WeightsError(f"tensor missing from the checkpoint ({name})", file=source, tensor=name)
        if out[name].shape != shape:
            raise WeightsError(f"shape {out[name].shape}, expected {shape}", file=source, tensor=name)
    return out


def load_nanochat(folder: Path, dt: np.dtype, progress: Callable | None = None):
    """A nanochat checkpoint folder (see the module docstring) as a :class:`Model`."""
    from polyengine.memory import check_weights_fit
    from polyengine.models.model import Model

    model_path, meta_path = _latest(folder)
    tokenizer = None
    tok_path = folder / "tokenizer.pkl"
    if tok_path.is_file():
        tokenizer = nanochat_tokenizer(read_tiktoken_pickle(tok_path), source=str(tok_path))
    eos = tuple(tokenizer.eos_token_ids) if tokenizer else ()
    config = nanochat_config(meta_path, eos=eos, bos=tokenizer.bos_token_id if tokenizer else None)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ModelConfigError(f"{tok_path}: {tokenizer.vocab_size} tokens, the model's vocab_size is "
                               f"{config.vocab_size}: the tokenizer does not belong to these weights")
    check_weights_fit(config, dt, str(folder))
    state = read_torch_state_dict(model_path)
    weights = {k: require_finite(v.astype(dt), file=model_path, tensor=k)
               for k, v in nanochat_weights(state, config, source=str(model_path)).items()}
    if progress is not None:
        progress(len(weights), len(weights), "nanochat weights")
    meta = {"format": "nanochat", "checkpoint": model_path.name, "dtype": str(dt)}
    return Model(config=config, weights=weights, tokenizer=tokenizer, source=str(folder), meta=meta)


# -- restricted unpickling --------------------------------------------------------------------

# torch storage class names -> NumPy dtypes (bfloat16 widened by hand: NumPy has no bfloat16).
_STORAGES = {"FloatStorage": "<f4", "DoubleStorage": "<f8", "HalfStorage": "<f2", "BFloat16Storage": "<u2",
             "LongStorage": "<i8", "IntStorage": "<i4", "ShortStorage": "<i2", "CharStorage": "i1",
             "ByteStorage": "u1", "BoolStorage": "?"}


class _Storage:
    def __init__(self, name: str):
        self.name = name


class _Restricted(pickle.Unpickler):
    """An unpickler that resolves only ``allowed`` globals (to the given stand-ins)."""

    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any], source: str,
                 persistent: Callable[[Any], Any] | None = None):
        super().__init__(io.BytesIO(data))
        self.allowed, self.source, self._persistent = allowed, source, persistent

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        raise WeightsError(f"refuses to unpickle {shown(module + '.' + name)}: only tensors, dicts and the "
                           f"tokenizer's own record are read (a model file that needs more is not loaded)",
                           file=self.source)

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise WeightsError("unexpected persistent reference in a pickle", file=self.source)
        return self._persistent(pid)


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> np.ndarray:
    """``torch._utils._rebuild_tensor_v2``'s stand-in: a strided view of the storage, copied."""
    ok = (isinstance(storage, np.ndarray) and isinstance(offset, int) and isinstance(size, tuple)
          and isinstance(stride, tuple) and len(size) == len(stride)
          and all(isinstance(v, int) and v >= 0 for v in (offset, *size, *stride)))
    if not ok:
        raise ValueError("malformed tensor record")
    last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else offset - 1
    if last >= storage.shape[0]:
        raise ValueError("tensor runs past its storage")
    item = storage.itemsize
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=size, strides=tuple(s * item for s in stride),
                                           writeable=False)
    return np.array(view)


def read_torch_state_dict(path: str | Path) -> dict[str, np.ndarray]:
    """A ``torch.save``'d dict of tensors (the zip format) as float32/integer NumPy
    arrays, never running code from the file (see the module docstring)."""
    path = Path(path)
    try:
        zf = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise WeightsError(f"not a torch zip checkpoint ({exc}); legacy (non-zip) torch files are not read",
                           file=path) from None
    with zf:
        names = zf.namelist()
        pkl = [n for n in names if n.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise WeightsError("no single data.pkl inside the checkpoint zip", file=path)
        prefix = pkl[0][: -len("data.pkl")]
        if prefix + "byteorder" in names and zf.read(prefix + "byteorder").strip() != b"little":
            raise WeightsError("big-endian checkpoints are not supported", file=path)
        storages: dict[str, np.ndarray] = {}

        def persistent(pid: Any) -> np.ndarray:
            if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Storage)
                    and isinstance(pid[2], str) and re.fullmatch(r"[0-9]+", pid[2])):
                raise WeightsError(f"unexpected persistent reference {shown(pid)}", file=path)
            key = pid[2]
            if key not in storages:
                member = f"{prefix}data/{key}"
                if member not in names:
                    raise WeightsError(f"storage {key} is missing from the zip", file=path)
                raw = np.frombuffer(zf.read(member), dtype=_STORAGES[pid[1].name])
                storages[key] = ((raw.astype(np.uint32) << 16).view(np.float32) if pid[1].name == "BFloat16Storage"
                                 else raw)
            return storages[key]

        allowed: dict[tuple[str, str], Any] = {("collections", "OrderedDict"): OrderedDict,
                                               ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor}
        allowed.update({("torch", name): _Storage(name) for name in _STORAGES})
        try:
            state = _Restricted(zf.read(pkl[0]), allowed, str(path), persistent).load()
        except WeightsError:
            raise
        except Exception as exc:  # a malformed pickle: whatever the unpickler raised
            raise WeightsError(f"cannot read the checkpoint's tensors: {type(exc).__name__}: {exc}", file=path) from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in state.items()):
        raise WeightsError("expected a dict of tensors (a state dict)", file=path)
    return dict(state)


class _EncodingRecord:
    """tiktoken ``Encoding``'s stand-in: keeps the pickled state, runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


def read_tiktoken_pickle(path: str | Path) -> dict[str, Any]:
    """nanochat's ``tokenizer.pkl`` (a pickled tiktoken encoding) as ``{"pat_str",
    "mergeable_ranks", "special_tokens"}``, checked, without importing tiktoken."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise WeightsError(f"cannot read: {exc.strerror or exc}", file=path) from None
    import copyreg

    allowed = {("tiktoken.core", "Encoding"): _EncodingRecord, ("copyreg", "_reconstructor"): copyreg._reconstructor,
               ("builtins", "object"): object}
    try:
        obj = _Restricted(data, allowed, str(path)).load()
    except WeightsError:
        raise
    except Exception as exc:
        raise WeightsError(f"cannot read the tokenizer pickle: {type(exc).__name__}: {exc}", file=path) from None
    state = obj.state if isinstance(obj, _EncodingRecord) else None
    ok = (isinstance(state, dict) and isinstance(state.get("pat_str"), str)
          and isinstance(state.get("mergeable_ranks"), dict) and isinstance(state.get("special_tokens"), dict)
          and all(isinstance(k, bytes) and isinstance(v, int) for k, v in state["mergeable_ranks"].items())
          and all(isinstance(k, str) and isinstance(v, int) for k, v in state["special_tokens"].items()))
    if not ok:
        raise WeightsError("not a tiktoken encoding (expected pat_str, mergeable_ranks, special_tokens)", file=path)
    return state


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge that makes each multi-byte token: run BPE on its bytes with only the
    lower ranks until two parts are left."""
    out = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best, at = None, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best is None or r < best):
                    best, at = r, i
            if best is None:
                break
            parts[at: at + 2] = [parts[at] + parts[at + 1]]
        if len(parts) != 2:
            raise ModelConfigError(f"tiktoken rank {rank} cannot be reached by merges; not a BPE vocabulary")
        out.append((parts[0], parts[1]))
    return out


def nanochat_tokenizer(state: dict[str, Any], *, source: str):
    """A :class:`Tokenizer` from a tiktoken encoding's state (nanochat's)."""
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    from polyengine.models.tokenizer import BYTE_TO_UNICODE, Tokenizer

    ranks: dict[bytes, int] = state["mergeable_ranks"]
    spell = lambda b: "".join(BYTE_TO_UNICODE[x] for x in b)  # noqa: E731
    vocab = {spell(t): r for t, r in ranks.items()}
    if len(vocab) != len(ranks) or sorted(ranks.values()) != list(range(len(ranks))):
        raise ModelConfigError(f"{source}: the ranks are not 0..{len(ranks) - 1}, one per token")
    merges = [(spell(a), spell(b)) for a, b in _merges(ranks)]
    backend = Backend(BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(state["pat_str"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    specials = sorted(state["special_tokens"].items(), key=lambda kv: kv[1])
    if [i for _, i in specials] != list(range(len(ranks), len(ranks) + len(specials))):
        raise ModelConfigError(f"{source}: special token ids must follow the ranks")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _ in specials])
    names = [t for t, _ in specials]
    bos = "<|bos|>" if "<|bos|>" in names else None
    extra = [state["special_tokens"][bos]] if bos else []
    return Tokenizer(backend, special_tokens={"bos_token": bos, "eos_token": "<|assistant_end|>"} if bos else {},
                     chat_template=NANOCHAT_TEMPLATE if "<|user_start|>" in names else None,
                     extra_eos_ids=extra, source=source)
