"""A stand-in for the Hugging Face Hub on a loopback port, for the hub tests.

It answers the requests huggingface_hub's own client makes for ``HfApi.model_info`` and
``hf_hub_download`` (read from the installed huggingface_hub 2.4 source), so with
``HF_ENDPOINT`` pointing here the real client code runs without a network:

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}``: the model info,
  ``sha`` (the commit) and ``siblings`` (``rfilename`` of each file);
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: the file, with the headers the client
  checks (``X-Repo-Commit``, ``ETag``, ``Content-Length``);
- errors as the Hub spells them: 404 with ``X-Error-Code`` ``RepoNotFound``,
  ``RevisionNotFound`` or ``EntryNotFound``; 401 with ``GatedRepo`` for a file of a
  gated repository asked without its token (``Authorization: Bearer TOKEN``; its info
  stays public, as on the Hub).

Revisions are refs (branches, tags) to commits; a commit is a dict of file paths to
bytes, its sha the SHA-1 of its content. Every request is recorded (``requests``:
method, path, Authorization header) so a test can say what was fetched.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

__all__ = ["HubStandin"]


@dataclass
class _Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    token: str | None = None  # gated: only this bearer token may read it


class HubStandin:
    def __init__(self) -> None:
        self.repos: dict[str, _Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        # A short poll: stop() returns within it (a test stops the hub to go offline).
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def commit(self, repo_id: str, files: dict[str, bytes], *, ref: str = "main", token: str | None = None) -> str:
        """Add a commit holding ``files`` and point ``ref`` at it; returns its sha."""
        repo = self.repos.setdefault(repo_id, _Repo())
        digest = hashlib.sha1()
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
        sha = digest.hexdigest()
        repo.commits[sha] = dict(files)
        repo.refs[ref] = sha
        repo.token = token if token is not None else repo.token
        return sha

    def fetched(self) -> list[str]:
        """The file paths downloaded (GET on resolve), in order."""
        return [path.split("/resolve/", 1)[1].split("/", 1)[1] for method, path, _ in self.requests
                if method == "GET" and "/resolve/" in path]

    def __enter__(self) -> "HubStandin":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()


def _handler(hub: HubStandin) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet: the test reads hub.requests
            pass

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _send(self, status: int, headers: dict[str, str], data: bytes, body: bool) -> None:
            self.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(key, value)
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _error(self, status: int, code: str, body: bool, extra: dict[str, str] | None = None) -> None:
            data = json.dumps({"error": code}).encode()
            self._send(status, {"X-Error-Code": code, "X-Error-Message": code, "Content-Type": "application/json",
                                **(extra or {})}, data, body)

        def _answer(self, body: bool) -> None:
            raw = urlsplit(self.path).path
            hub.requests.append((self.command, unquote(raw), self.headers.get("Authorization")))
            parts = [unquote(p) for p in raw.strip("/").split("/")]
            api = parts[:2] == ["api", "models"]
            if api:
                parts = parts[2:]
            repo_id = "/".join(parts[:2])
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", body)
            if (repo.token is not None and not api  # as on the Hub, a gated repository's info is public
                    and self.headers.get("Authorization") != f"Bearer {repo.token}"):
                return self._error(401, "GatedRepo", body)
            if api:
                rev = parts[3] if len(parts) == 4 and parts[2] == "revision" else "main"
            elif len(parts) >= 5 and parts[2] == "resolve":
                rev = parts[3]
            else:
                return self._error(404, "NotFound", body)
            sha = rev if rev in repo.commits else repo.refs.get(rev)
            if sha is None:
                return self._error(404, "RevisionNotFound", body)
            files = repo.commits[sha]
            if api:
                info = {"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                        "gated": "manual" if repo.token else False, "disabled": False,
                        "siblings": [{"rfilename": f} for f in sorted(files)]}
                return self._send(200, {"Content-Type": "application/json"}, json.dumps(info).encode(), body)
            path = "/".join(parts[4:])
            if path not in files:
                return self._error(404, "EntryNotFound", body, {"X-Repo-Commit": sha})
            data = files[path]
            self._send(200, {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                             "Content-Type": "application/octet-stream"}, data, body)

    return Handler
