"""A local HTTP server speaking the part of the Hugging Face Hub's API that `huggingface_hub` downloads
through: repo info, the file tree, and `resolve` with its commit and etag headers (Range requests too)."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


@dataclass
class SeenRequest:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class FakeHub:
    """`repos`: repo id -> {file path: content}. Each repo's single commit is the sha1 of its id."""

    repos: dict[str, dict[str, bytes]]
    # file name -> bytes after which the first GET of it drops the connection (an interrupted download)
    cut_after: dict[str, int] = field(default_factory=dict)
    requests: list[SeenRequest] = field(default_factory=list)

    def __post_init__(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test output clean
                pass

            def do_HEAD(self):
                hub._handle(self, body=False)

            def do_GET(self):
                hub._handle(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def commit(repo_id: str) -> str:
        return hashlib.sha1(repo_id.encode()).hexdigest()

    def downloads(self, repo_id: str) -> list[str]:
        """Files of `repo_id` fetched with GET (their content sent), in order."""
        prefix = f"/{repo_id}/resolve/"
        return [r.path[len(prefix):].split("/", 1)[1] for r in self.requests
                if r.method == "GET" and r.path.startswith(prefix)]

    # -- routes --------------------------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append(SeenRequest(h.command, path, {k.lower(): v for k, v in h.headers.items()}))
        parts = path.strip("/").split("/")
        if parts[0] == "api" and len(parts) >= 6 and parts[1] == "models" and parts[4] in ("revision", "tree"):
            repo_id, rev = "/".join(parts[2:4]), parts[5]
            files = self._files(h, repo_id, rev)
            if files is None:
                return
            if parts[4] == "revision":
                info = {"id": repo_id, "modelId": repo_id, "sha": self.commit(repo_id), "private": False,
                        "siblings": [{"rfilename": name} for name in files]}
            else:
                info = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                        for name, data in files.items()]
            return self._send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            files = self._files(h, repo_id, rev)
            if files is None:
                return
            if name not in files:
                return self._error(h, 404, "EntryNotFound", f"{name} not in {repo_id}")
            data = files[name]
            headers = {"X-Repo-Commit": self.commit(repo_id), "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                       "Content-Type": "application/octet-stream"}
            start = 0
            if body and h.headers.get("Range", "").startswith("bytes="):
                start = int(h.headers["Range"][len("bytes="):].split("-")[0])
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            cut = self.cut_after.pop(name, None) if body else None
            return self._send(h, 206 if start else 200, data[start:], headers, body, cut)
        self._error(h, 404, "EntryNotFound", f"no route {path}")

    def _files(self, h, repo_id: str, rev: str) -> dict[str, bytes] | None:
        if repo_id not in self.repos:
            self._error(h, 404, "RepoNotFound", f"Repository {repo_id} not found")
            return None
        if rev not in ("main", self.commit(repo_id)):
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return None
        return self.repos[repo_id]

    def _error(self, h, status: int, code: str, message: str) -> None:
        self._send(h, status, json.dumps({"error": message}).encode(),
                   {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message}, True)

    @staticmethod
    def _send(h, status: int, data: bytes, headers: dict[str, str], body: bool, cut: int | None = None) -> None:
        h.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(data))}.items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data if cut is None else data[:cut])
        if cut is not None:
            h.wfile.flush()
            h.close_connection = True
