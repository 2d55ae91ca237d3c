"""A tiny stand-in for the Hugging Face Hub's file routes, served on loopback.

``huggingface_hub.hf_hub_download`` talks to ``{HF_ENDPOINT}/{repo_id}/resolve/{revision}/{path}``:
a HEAD for the commit, ETag and size, then a GET for the bytes, and it reads failures from the
``X-Error-Code`` header. This server answers exactly those routes from repositories held in
memory, so an importer's online calls run unchanged against it (no network), and what they
cache under ``HF_HOME`` is then what ``HF_HUB_OFFLINE=1`` serves.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote


@dataclass
class MirrorRepo:
    """One model repository: one commit, its files."""

    files: dict[str, bytes]
    """Repo-relative path → bytes."""
    commit: str = ""
    """40 hex digits; derived from the files when empty."""
    branches: tuple[str, ...] = ("main",)
    gets: list[str] = field(default_factory=list)
    """Paths downloaded (GET) so far, in order."""

    def __post_init__(self) -> None:
        if not self.commit:
            digest = hashlib.sha1()
            for path in sorted(self.files):
                digest.update(path.encode() + hashlib.sha256(self.files[path]).digest())
            self.commit = digest.hexdigest()


class HubMirror:
    def __init__(self) -> None:
        self.repos: dict[str, MirrorRepo] = {}
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self):
                mirror._answer(self, with_body=False)

            def do_GET(self):
                mirror._answer(self, with_body=True)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, handler: BaseHTTPRequestHandler, with_body: bool) -> None:
        parts = unquote(handler.path.split("?")[0]).strip("/").split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            return self._fail(handler, 404, "")
        repo_id, revision, path = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._fail(handler, 404, "RepoNotFound")
        if revision not in (*repo.branches, repo.commit):
            return self._fail(handler, 404, "RevisionNotFound")
        data = repo.files.get(path)
        if data is None:
            return self._fail(handler, 404, "EntryNotFound")
        handler.send_response(200)
        handler.send_header("X-Repo-Commit", repo.commit)
        handler.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if with_body:
            repo.gets.append(path)
            handler.wfile.write(data)

    @staticmethod
    def _fail(handler: BaseHTTPRequestHandler, status: int, error_code: str) -> None:
        handler.send_response(status)
        if error_code:
            handler.send_header("X-Error-Code", error_code)
            handler.send_header("X-Error-Message", error_code)
        handler.send_header("Content-Length", "0")
        handler.end_headers()
