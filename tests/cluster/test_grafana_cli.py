"""``ferrox grafana push``: exit codes, messages, and what it sends a Grafana.

The unreachable case is real: the CLI in its own process against a loopback
port nothing listens on. A real Grafana cannot run here (no Debian or PyPI
package ships one), so the other tests use a small stand-in HTTP server
that answers the four Grafana API calls the push makes (folders list and
create, dashboard create-or-update) with Grafana's status codes and
shapes, and records what it received. They check the push's side of the
contract: idempotence by uid, the folder found or created once, the
credentials sent, and the messages when Grafana says no.
"""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ferrox.cli import main

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "ferrox.json"
TOKEN = "glsa_good-token"
USER, PASSWORD = "admin", "s3cret"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandInGrafana:
    """Grafana's folder and dashboard API, in memory, under an optional path prefix."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.folders: list[dict] = []
        self.dashboards: dict[str, dict] = {}
        self.requests: list[tuple[str, str, str | None, dict | None]] = []  # method, path, auth, body
        grafana = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                auth = self.headers.get("Authorization")
                grafana.requests.append((method, self.path, auth, body))
                if not self.path.startswith(grafana.prefix + "/api/"):
                    return self._answer(404, {"message": "Not found"})
                path = self.path[len(grafana.prefix):]
                good_basic = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
                if auth not in (f"Bearer {TOKEN}", good_basic):
                    return self._answer(401, {"message": "invalid API key"})
                if (method, path) == ("GET", "/api/folders"):
                    return self._answer(200, grafana.folders)
                if (method, path) == ("POST", "/api/folders"):
                    if any(f["uid"] == body["uid"] for f in grafana.folders):
                        return self._answer(409, {"message": "a folder with the same uid already exists"})
                    folder = {"id": len(grafana.folders) + 1, "uid": body["uid"], "title": body["title"]}
                    grafana.folders.append(folder)
                    return self._answer(200, folder)
                if (method, path) == ("POST", "/api/dashboards/db"):
                    board = body["dashboard"]
                    uid = board["uid"]
                    old = grafana.dashboards.get(uid)
                    if old is not None and not body.get("overwrite"):
                        return self._answer(412, {"message": "The dashboard has been changed by someone else",
                                                  "status": "version-mismatch"})
                    version = (old["version"] if old else 0) + 1
                    grafana.dashboards[uid] = {"dashboard": board, "version": version,
                                               "folderUid": body.get("folderUid")}
                    return self._answer(200, {"id": 7, "uid": uid, "url": f"/d/{uid}/{board['title']}",
                                              "status": "success", "version": version, "slug": board["title"]})
                return self._answer(404, {"message": "Not found"})

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{prefix}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def grafana():
    g = StandInGrafana()
    yield g
    g.close()


def test_push_to_an_unreachable_grafana_fails_with_a_clear_message_and_status_2():
    url = f"http://127.0.0.1:{_closed_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "ferrox.cli", "grafana", "push", "--url", url, "--token", TOKEN],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == f"ferrox grafana push: cannot reach Grafana at {url}: Connection refused\n"


def test_a_first_push_creates_the_dashboard_and_a_second_replaces_it(grafana, capsys):
    argv = ["grafana", "push", "--url", grafana.url, "--token", TOKEN, "--folder", "LLM serving"]
    assert main(argv) == 0
    assert capsys.readouterr().out == f"dashboard ferrox pushed to {grafana.url}/d/ferrox/ferrox (version 1)\n"
    assert main(argv) == 0
    assert capsys.readouterr().out == f"dashboard ferrox pushed to {grafana.url}/d/ferrox/ferrox (version 2)\n"

    assert grafana.folders == [{"id": 1, "uid": "llm-serving", "title": "LLM serving"}]
    assert list(grafana.dashboards) == ["ferrox"]
    stored = grafana.dashboards["ferrox"]
    assert (stored["version"], stored["folderUid"]) == (2, "llm-serving")
    assert stored["dashboard"] == {**json.loads(DASHBOARD.read_text()), "id": None}
    posts = [body for method, path, _, body in grafana.requests if path == "/api/dashboards/db"]
    assert len(posts) == 2
    assert all(p["overwrite"] is True and p["folderId"] == 1 for p in posts)
    assert {auth for _, _, auth, _ in grafana.requests} == {f"Bearer {TOKEN}"}
    # The folder was looked up both times and created once.
    calls = [(m, p) for m, p, _, _ in grafana.requests]
    assert calls == [("GET", "/api/folders"), ("POST", "/api/folders"), ("POST", "/api/dashboards/db"),
                     ("GET", "/api/folders"), ("POST", "/api/dashboards/db")]


def test_a_push_with_basic_auth_under_a_path_prefix_reaches_the_api_there(capsys):
    g = StandInGrafana(prefix="/grafana")
    try:
        assert main(["grafana", "push", "--url", g.url + "/", "--user", USER, "--password", PASSWORD]) == 0
    finally:
        g.close()
    assert [(m, p) for m, p, _, _ in g.requests] == [("POST", "/grafana/api/dashboards/db")]
    assert g.requests[0][2] == "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    assert g.dashboards["ferrox"]["folderUid"] is None
    assert capsys.readouterr().out == f"dashboard ferrox pushed to {g.url}/d/ferrox/ferrox (version 1)\n"


def test_rejected_credentials_fail_with_a_clear_message_and_status_2(grafana, capsys):
    assert main(["grafana", "push", "--url", grafana.url, "--user", USER, "--password", "wrong"]) == 2
    err = capsys.readouterr().err
    assert err == (f"ferrox grafana push: Grafana at {grafana.url} rejected the credentials (HTTP 401); "
                   "check --token or --user/--password (the account needs dashboard write access)\n")
    assert grafana.dashboards == {}


def test_a_push_without_credentials_is_refused_before_any_request(grafana, capsys):
    assert main(["grafana", "push", "--url", grafana.url]) == 2
    assert "credentials required" in capsys.readouterr().err
    assert grafana.requests == []


def test_a_missing_dashboard_file_fails_with_status_2(grafana, tmp_path, capsys):
    missing = tmp_path / "nope.json"
    assert main(["grafana", "push", "--url", grafana.url, "--token", TOKEN, "--dashboard", str(missing)]) == 2
    assert capsys.readouterr().err == f"ferrox grafana push: dashboard file {missing} does not exist\n"
    assert grafana.requests == []


def test_a_url_that_is_not_http_fails_with_status_2(capsys):
    assert main(["grafana", "push", "--url", "grafana:3000", "--token", TOKEN]) == 2
    assert "--url must be an http(s) URL" in capsys.readouterr().err


def test_a_url_without_grafanas_api_fails_with_status_2(capsys):
    g = StandInGrafana(prefix="/grafana")
    try:
        # Grafana is under /grafana; the URL misses the prefix.
        url = g.url.removesuffix("/grafana")
        assert main(["grafana", "push", "--url", url, "--token", TOKEN]) == 2
    finally:
        g.close()
    assert capsys.readouterr().err == (
        f"ferrox grafana push: no Grafana API at {url}/api (HTTP 404); check --url, including any path "
        "prefix Grafana is served under\n")
    assert g.dashboards == {}
