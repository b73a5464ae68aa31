"""Models by name: ``ORG/NAME[@REVISION][:QUANT | :FILE.gguf]`` from the Hugging Face Hub.

This module turns a hub name into local files and knows nothing about loading them:
:func:`polyengine.models.load_model` calls :func:`resolve` and loads what it returns
(an HF folder or one ``.gguf`` file) like any local path. Files are fetched through
``huggingface_hub`` (the ``hub`` extra, imported only when a hub name is used) into its
standard cache, so ``HF_HOME``/``HF_HUB_CACHE``, ``HF_ENDPOINT``, ``HF_TOKEN`` and
``HF_HUB_OFFLINE`` mean what they mean for every other Hugging Face tool.

Rules (docs/models.md, "Models by name"; tests/test_hub.py proves them against a local
stand-in for the Hub):

- A name is ``ORG/NAME`` (the Hub's repo id rules), then ``@REVISION`` (a branch, tag or
  commit; default ``main``), then ``:SELECTOR``. ``hf.co/`` or ``huggingface.co/`` in
  front is accepted, as Ollama writes it. Revisions never contain ``:`` (git forbids it),
  so the first ``:`` starts the selector.
- Without a selector a repository with ``config.json`` and safetensors weights is an HF
  folder; only what the loader reads is downloaded (config, tokenizer files, the
  checkpoint: ``model.safetensors``, else the index and the shards it names, else the
  one ``*.safetensors``). A GGUF-only repository gives its one ``.gguf`` file, or the
  ``Q4_K_M`` one when there are several, as llama.cpp's ``-hf`` defaults.
- ``:TAG`` picks the ``.gguf`` file whose name holds the tag (case-insensitive, between
  separators: ``Q4_K`` does not match ``Q4_K_M``). ``:FILE.gguf`` names the file. No
  match, several matches or a split (``-00001-of-0000N``) file is a :class:`ModelNotFound`
  / :class:`UnsupportedFeature` that lists the repository's GGUF files.
- The listing comes from the Hub; when the Hub cannot be asked (``HF_HUB_OFFLINE=1``, no
  connection, a server error) the cached snapshot of the revision is used, and a file
  that is not there is a :class:`ModelNotFound` naming it and the way to fetch it.
- Download progress is huggingface_hub's own bars on stderr, turned off by
  ``progress=False`` (the CLI's ``-q``) or ``HF_HUB_DISABLE_PROGRESS_BARS=1``.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

from polyengine.errors import MissingExtra, ModelNotFound, UnsupportedFeature

__all__ = ["HubName", "INSTALL_HINT", "parse_hub_name", "resolve", "select_files", "cached_models"]

INSTALL_HINT = "pip install 'polyengine[hub]'"

# The Hub's repo id rules (huggingface_hub's validate_repo_id): word characters, '-' and
# '.', at most 96 characters, no '--' or '..', not ending in '.git'. An owner is required
# here: a bare word is far more often a mistyped path than a legacy unowned repo.
_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Branches, tags (git's ref rules, narrowed: no '..', no leading or trailing '/') and commits.
_REVISION_RE = re.compile(r"^(?!.*\.\.)(?!/)[\w.\-/]+(?<!/)$")
_PREFIXES = ("https://huggingface.co/", "https://hf.co/", "huggingface.co/", "hf.co/")
_SPLIT_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
# llama.cpp's -hf picks this quant when the name gives none.
DEFAULT_QUANT = "Q4_K_M"
# What the loader reads from an HF folder besides the weights (loader.py, tokenizer_files.py).
_FOLDER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja")
_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class HubName:
    """A parsed hub name. ``selector`` is a quant tag or a ``.gguf`` file path, or None."""

    repo_id: str
    revision: str | None = None
    selector: str | None = None

    def __str__(self) -> str:
        return (self.repo_id + (f"@{self.revision}" if self.revision else "")
                + (f":{self.selector}" if self.selector else ""))


def parse_hub_name(text: str) -> HubName | None:
    """The hub name ``text`` spells, or None when it is not one (a typo'd path, a word)."""
    for prefix in _PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    left, colon, selector = text.partition(":")
    repo, at, revision = left.partition("@")
    if (not _REPO_RE.match(repo) or len(repo) > 96 or "--" in repo or ".." in repo
            or repo.lower().endswith((".git", ".gguf", ".safetensors", ".json"))  # a mistyped file path
            or (at and not _REVISION_RE.match(revision)) or (colon and not selector.strip())):
        return None
    return HubName(repo, revision or None, selector or None)


# -- choosing files ----------------------------------------------------------------------


def _tag_matches(path: str, tag: str) -> bool:
    # The tag as a whole field of the name: after a separator, before '.', '-' or the end.
    return re.search(rf"(?:^|[^a-z0-9]){re.escape(tag.lower())}(?=[.\-]|$)", path.lower()) is not None


def select_files(name: HubName, files: list[str]) -> tuple[str, list[str]]:
    """``(kind, files to fetch)`` for ``name`` from a repository listing; kind is
    ``"gguf"`` (one file) or ``"folder"``. The shards named by an index are added by
    :func:`resolve` once the index is read."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    listed = f"its GGUF files: {', '.join(ggufs)}" if ggufs else "it has no .gguf files"
    sel = name.selector
    if sel is not None:
        if sel.lower().endswith(".gguf"):
            if sel not in files:
                raise ModelNotFound(f"{name}: the repository has no file {sel!r}; {listed}")
            chosen = [sel]
        else:
            chosen = [f for f in ggufs if _tag_matches(f, sel)]
            if not chosen:
                raise ModelNotFound(f"{name}: no GGUF file matches the quant tag {sel!r}; {listed} "
                                    f"(pick one with :TAG or :FILE.gguf)")
        return "gguf", _one_gguf(name, chosen, listed)
    top = [f for f in files if "/" not in f]
    weights = [f for f in top if f.endswith(".safetensors")]
    if "config.json" in top and (weights or _INDEX in top):
        if "model.safetensors" in top:
            weights = ["model.safetensors"]
        elif _INDEX in top:
            weights = [_INDEX]
        return "folder", [f for f in _FOLDER_FILES if f in top] + weights
    if ggufs:
        if len(ggufs) == 1:
            return "gguf", ggufs
        default = [f for f in ggufs if _tag_matches(f, DEFAULT_QUANT)]
        if default:
            return "gguf", _one_gguf(name, default, listed)
        raise ModelNotFound(f"{name}: the repository holds several GGUF files and none is {DEFAULT_QUANT}; pick "
                            f"one with {name.repo_id}:TAG or {name.repo_id}:FILE.gguf; {listed}")
    other = ", ".join(sorted(files)[:20]) or "no files"
    raise ModelNotFound(
        f"{name}: the repository holds neither an HF checkpoint polyengine can load (config.json + *.safetensors) "
        f"nor a .gguf file (it has: {other}). PyTorch .bin checkpoints are never loaded (they are pickles)")


def _one_gguf(name: HubName, chosen: list[str], listed: str) -> list[str]:
    if len(chosen) == 1 and not _SPLIT_RE.search(chosen[0]):
        return chosen
    if chosen and all(_SPLIT_RE.search(f) for f in chosen):
        raise UnsupportedFeature(
            "split GGUF files", detail=f"{name} selects a model split into {len(chosen)} files "
            f"({', '.join(chosen)}); merge them with llama.cpp's llama-gguf-split --merge and pass the file")
    raise ModelNotFound(f"{name}: the tag {name.selector or DEFAULT_QUANT!r} matches several GGUF files "
                        f"({', '.join(chosen)}); name one with :FILE.gguf; {listed}")


# -- fetching ------------------------------------------------------------------------------


def _hub() -> Any:
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
        import huggingface_hub.file_download
        import huggingface_hub.utils
    except ImportError:
        raise MissingExtra("loading a model by its Hugging Face name", package="huggingface_hub",
                           install=INSTALL_HINT) from None
    return huggingface_hub


def _cached_listing(hf: Any, name: HubName) -> tuple[str, list[str]] | None:
    """``(commit, files)`` of the revision's cached snapshot, or None when there is none."""
    storage = Path(hf.constants.HF_HUB_CACHE) / hf.file_download.repo_folder_name(
        repo_id=name.repo_id, repo_type="model")
    revision = name.revision or "main"
    commit = revision
    if not re.fullmatch(r"[0-9a-f]{40}", revision):
        ref = storage / "refs" / revision
        if not ref.is_file():
            return None
        commit = ref.read_text().strip()
    if not re.fullmatch(r"[0-9a-f]{40}", commit):  # a damaged ref names no snapshot
        return None
    snapshot = storage / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    files = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    return commit, files


def _remote_listing(hf: Any, name: HubName) -> tuple[str, list[str]] | BaseException:
    """``(commit, files)`` from the Hub, or the error that kept it from answering (to
    fall back on the cache); a repository, revision or access refusal raises at once."""
    errors = hf.errors
    try:
        info = hf.HfApi().model_info(name.repo_id, revision=name.revision)
    except errors.GatedRepoError:
        raise ModelNotFound(
            f"{name}: the repository is gated or private and the Hub refused this request; accept its terms on "
            f"the Hub and set HF_TOKEN to a token of an account with access (or run `hf auth login`)") from None
    except errors.RevisionNotFoundError:
        raise ModelNotFound(f"{name}: the repository has no revision {name.revision!r} (a branch, tag or commit)"
                            ) from None
    except errors.RepositoryNotFoundError:
        raise ModelNotFound(
            f"{name}: no such repository on {hf.constants.ENDPOINT} (or it is private: set HF_TOKEN); and no local "
            f"path {str(name)!r} exists") from None
    except errors.HfHubHTTPError as exc:
        status = getattr(exc.response, "status_code", None) if exc.response is not None else None
        if status is not None and 400 <= status < 500:  # refused (a bad token, say), not unreachable
            first = str(exc).strip().splitlines()[0]
            raise ModelNotFound(f"{name}: the Hub refused the request ({first}); check HF_TOKEN") from None
        return exc
    except Exception as exc:  # noqa: BLE001 - offline, no connection, a timeout: the cache may answer
        return exc
    return info.sha, [s.rfilename for s in info.siblings or ()]


def _listing(hf: Any, name: HubName) -> tuple[str, list[str], str | None]:
    """``(commit, files, why)``: from the Hub (``why`` None), else from the cache, with
    why the Hub was not asked."""
    offline = bool(hf.constants.HF_HUB_OFFLINE)
    remote = None if offline else _remote_listing(hf, name)
    if isinstance(remote, tuple):
        return (*remote, None)
    why = ("HF_HUB_OFFLINE is set" if offline
           else f"{hf.constants.ENDPOINT} could not be reached ({type(remote).__name__}: {remote})")
    cached = _cached_listing(hf, name)
    if cached is None:
        raise ModelNotFound(f"{name} is not in the Hugging Face cache ({hf.constants.HF_HUB_CACHE}) and {why}; "
                            f"fetch it first with `polyengine pull {name}` while online")
    return (*cached, why)


def resolve(name: HubName, *, progress: bool = True) -> Path:
    """The local path of ``name``'s files (an HF folder or a ``.gguf`` file), downloaded
    into the Hugging Face cache when they are not there yet."""
    hf = _hub()
    commit, files, cache_only = _listing(hf, name)
    try:
        kind, wanted = select_files(name, files)
    except ModelNotFound as exc:
        if cache_only is None:
            raise
        raise ModelNotFound(f"{exc} (these are the files cached for revision {commit[:12]}: {cache_only}, so the "
                            f"Hub was not asked; `polyengine pull {name}` while online fetches more)") from None
    local = cache_only is not None
    with _bars(hf, progress):
        fetched = {f: _fetch(hf, name, f, commit, local) for f in wanted}
        if kind == "folder" and _INDEX in fetched:
            fetched.update({f: _fetch(hf, name, f, commit, local) for f in _shards(fetched[_INDEX], name)})
    # Each file sits at snapshots/<commit>/<its path>: one commit for all, the listing's.
    snapshots = {Path(str(path)[: -len(f)]) for f, path in fetched.items()}
    if len(snapshots) != 1 or next(iter(snapshots)).name != commit:
        raise ModelNotFound(f"{name}: the revision moved while it was downloading; run the command again")
    return fetched[wanted[0]] if kind == "gguf" else next(iter(snapshots))


def _fetch(hf: Any, name: HubName, filename: str, commit: str, local_only: bool) -> Path:
    errors = hf.errors
    try:
        # The name's own revision (not the commit) so that the cache records where the branch
        # or tag points, and an offline run of the same name finds it.
        return Path(hf.hf_hub_download(name.repo_id, filename, revision=name.revision,
                                       local_files_only=local_only))
    except errors.LocalEntryNotFoundError:
        raise ModelNotFound(
            f"{name}: {filename} (revision {commit[:12]}) is not in the Hugging Face cache "
            f"({hf.constants.HF_HUB_CACHE}) and the Hub cannot be asked now; fetch it with `polyengine pull {name}` "
            f"while online") from None
    except errors.GatedRepoError:
        raise ModelNotFound(f"{name}: {filename}: the repository is gated or private; set HF_TOKEN to a token with "
                            f"access") from None
    except errors.EntryNotFoundError:
        raise ModelNotFound(f"{name}: the repository lists {filename} but the Hub has no such file") from None
    except Exception as exc:  # noqa: BLE001 - a dropped connection, a full disk: say which file, keep the rest
        raise ModelNotFound(f"{name}: downloading {filename} failed ({type(exc).__name__}: {exc}); run the command "
                            f"again (the files already fetched stay in the cache)") from exc


def _shards(index: Path, name: HubName) -> list[str]:
    from polyengine.files import read_regular
    from polyengine.limits import MAX_JSON_BYTES

    def bad(msg: str) -> ModelNotFound:
        return ModelNotFound(f"{name}: {_INDEX}: {msg}")

    try:
        weight_map = json.loads(read_regular(index, limit=MAX_JSON_BYTES, what="shard index", error=bad))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise bad("not a JSON object with a weight_map of tensor names to shard files") from None
    if not all(isinstance(s, str) and s.endswith(".safetensors") and not PurePosixPath(s).is_absolute()
               and ".." not in PurePosixPath(s).parts for s in shards):
        raise bad("its weight_map names files that are not .safetensors shards inside the repository")
    return shards


@contextlib.contextmanager
def _bars(hf: Any, show: bool) -> Iterator[None]:
    """huggingface_hub's progress bars off for a quiet caller (and back on afterwards)."""
    hide = not show and not hf.utils.are_progress_bars_disabled()
    if hide:
        hf.utils.disable_progress_bars()
    try:
        yield
    finally:
        if hide:
            hf.utils.enable_progress_bars()


# -- the cache -----------------------------------------------------------------------------


def cached_models() -> Iterator[dict[str, Any]]:
    """One record per cached model revision: repo, commit, refs, format, files, size,
    path and the names that load it (``polyengine models``)."""
    hf = _hub()
    try:
        info = hf.scan_cache_dir(hf.constants.HF_HUB_CACHE)
    except hf.errors.CacheNotFound:
        return
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: -r.last_modified):
            files = sorted(f.file_path.relative_to(rev.snapshot_path).as_posix() for f in rev.files)
            ggufs = [f for f in files if f.lower().endswith(".gguf")]
            refs = sorted(rev.refs)
            at = "" if "main" in refs else f"@{refs[0] if refs else rev.commit_hash}"
            folder = "config.json" in files and any(f.endswith(".safetensors") for f in files)
            formats = ["safetensors"] * folder + ["gguf"] * bool(ggufs)
            yield {
                "repo": repo.repo_id, "commit": rev.commit_hash, "refs": refs,
                "format": "+".join(formats) or "other", "files": files, "size_bytes": rev.size_on_disk,
                "path": str(rev.snapshot_path),
                "names": [f"{repo.repo_id}{at}"] * folder + [f"{repo.repo_id}{at}:{g}" for g in ggufs],
            }
