"""What the commands that load a model check before its weights load.

Loading the default model takes seconds and a large one minutes, so a mistake in the
command line is reported first: the backend (unknown or unusable here), its
``--option`` values (the backend's own option table, which imports no framework), the
context length against the model's position limit (read from its header or
``config.json`` only when ``--context-length`` is given), and, for commands that turn
text into tokens, a model folder without ``tokenizer.json``. What cannot be known
without loading (a plugin's model name) is left to the load, which checks the same
things again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from polyengine.errors import InvalidRequest, ModelConfigError

__all__ = ["check_before_loading"]


def check_before_loading(model: Any, *, backend: str, options: Mapping[str, Any], context_length: int | None,
                         needs_tokenizer: bool) -> None:
    """Raise the typed error a load would end in, naming the flag to change."""
    from polyengine.options import check_options
    from polyengine.selection import select_backend

    if context_length is not None and context_length < 2:
        raise InvalidRequest(f"--context-length must be at least 2 (prompt + completion tokens), got {context_length}")
    info = select_backend(backend)  # an unknown or unavailable backend, with every backend's reason
    if options and info.spec.options is not None:  # a spec naming no table: the engine checks them when built
        try:
            check_options(info.option_table(), options, backend=info.name)
        except InvalidRequest as exc:
            raise InvalidRequest(f"--option: {exc} (`polyengine backends --verbose` lists each backend's options)",
                                 field=exc.field) from None
    where = _local_model(model)
    if where is None:
        return
    kind, path = where
    if kind == "hf" and needs_tokenizer and not (path / "tokenizer.json").exists():
        raise ModelConfigError(
            f"{path} has no tokenizer.json, which turns the prompt's text into tokens; fix: copy tokenizer.json from "
            f"the model's repository into that folder (e.g. `huggingface-cli download ORG/NAME tokenizer.json "
            f"--local-dir {path}`)")
    if context_length is None:
        return
    limit = _position_limit(kind, path, model)
    if context_length > limit:
        raise InvalidRequest(f"--context-length {context_length} exceeds this model's {limit:,} positions "
                             f"(max_position_embeddings); pass --context-length {limit} or less",
                             field="context_length")


def _local_model(model: Any) -> tuple[str, Any] | None:
    """("gguf", file), ("hf", folder) or ("random", spec) as the loader will read it,
    or None where only loading can tell (a plugin's model name, a nanochat checkpoint,
    a folder of several .gguf files, which the load refuses)."""
    if model is None:
        from polyengine.models.loader import default_model_path

        return "gguf", default_model_path()
    text = str(model)
    if text.startswith("random:"):
        return "random", text
    path = Path(text).expanduser()
    if not text.strip() or not path.exists():
        return None
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf", path
        ggufs = sorted(path.glob("*.gguf"))
        return ("gguf", ggufs[0]) if len(ggufs) == 1 else None
    return ("gguf", path) if path.suffix.lower() == ".gguf" else None


def _position_limit(kind: str, path: Any, model: Any) -> int:
    if kind == "random":
        from polyengine.models.presets import preset_config

        return preset_config(str(model).removeprefix("random:").partition("?")[0]).max_position_embeddings
    if kind == "hf":
        from polyengine.models.config_files import config_from_file

        return config_from_file(path / "config.json").max_position_embeddings
    from polyengine.models.gguf_io import read_gguf

    return read_gguf(path).config().max_position_embeddings
