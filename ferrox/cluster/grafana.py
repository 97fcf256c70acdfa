"""``ferrox grafana push``: create or update the ferrox dashboard in a Grafana.

Decided here:

- Idempotent by the dashboard's ``uid``: the dashboard goes to Grafana's
  ``POST /api/dashboards/db`` with ``id`` cleared and ``overwrite`` set, so
  a first push creates it and every later push replaces it (Grafana bumps
  its version). ``--folder`` names a folder by title: found if it exists,
  created (uid derived from the title) if not.
- Credentials: ``--token`` (a service-account token, sent as a bearer
  token) or ``--user`` with ``--password`` (basic auth); one of the two is
  required.
- Exit codes, as the CLI's: 0 pushed; 2 for bad usage and for clear
  operational errors, each with one line on stderr that says what to do:
  Grafana unreachable (connection refused, DNS, timeout), credentials
  refused (401/403), the dashboard file missing or not JSON, the
  ``grafana`` extra not installed, any other answer Grafana refuses with.
- Through the ``grafana-api`` package (the ``grafana`` extra).

Deliberately not here: creating the Prometheus data source (the
dashboard asks for one through its ``$datasource`` variable), alerting,
and dashboard permissions.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEFAULT_DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "ferrox.json"
"""The dashboard shipped in the source tree (``deploy/grafana/ferrox.json``)."""

TIMEOUT_S = 10.0


class PushError(Exception):
    """A clear operational error: its message is the one line the user sees."""


def _fail(message: str) -> int:
    print(f"ferrox grafana push: {message}", file=sys.stderr)
    return 2


def load_dashboard(path: str | Path | None) -> dict:
    """The dashboard JSON at ``path`` (default :data:`DEFAULT_DASHBOARD`).

    Raises :class:`PushError` when it is missing, not JSON, or has no ``uid``.
    """
    p = Path(path) if path else DEFAULT_DASHBOARD
    if not p.is_file():
        hint = "" if path else " (not running from a source checkout? pass --dashboard PATH)"
        raise PushError(f"dashboard file {p} does not exist{hint}")
    try:
        board = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise PushError(f"dashboard file {p} is not valid JSON: {exc}") from None
    if not isinstance(board, dict) or not board.get("uid"):
        raise PushError(f"dashboard file {p} has no \"uid\": it is not a Grafana dashboard")
    return board


def _client(url: str, auth: Any):
    from grafana_api.grafana_face import GrafanaFace

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PushError(f"--url must be an http(s) URL such as http://127.0.0.1:3000, got {url!r}")
    prefix = parts.path.strip("/")
    return GrafanaFace(
        auth,
        host=parts.hostname,
        port=parts.port,
        url_path_prefix=f"{prefix}/" if prefix else "",
        protocol=parts.scheme,
        timeout=TIMEOUT_S,
    )


def folder_uid(title: str) -> str:
    """The uid a folder created for ``title`` gets: lowercase, ``[a-z0-9-]``, at most 40 chars."""
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:40]
    return slug or "ferrox"


def _ensure_folder(grafana, title: str) -> dict:
    for folder in grafana.folder.get_all_folders() or []:
        if folder.get("title") == title:
            return folder
    return grafana.folder.create_folder(title, uid=folder_uid(title))


def push(url: str, auth: Any, board: dict, folder: str | None = None) -> dict:
    """Create or replace ``board`` in the Grafana at ``url``; returns Grafana's answer
    (``uid``, ``url``, ``version``, ``status``). ``auth``: a token string or a
    ``(user, password)`` tuple. Raises what ``grafana_api`` and ``requests`` raise."""
    grafana = _client(url, auth)
    payload: dict[str, Any] = {
        "dashboard": {**board, "id": None},
        "overwrite": True,
        "message": "ferrox grafana push",
    }
    if folder:
        f = _ensure_folder(grafana, folder)
        payload["folderUid"] = f.get("uid")
        if f.get("id") is not None:
            payload["folderId"] = f["id"]  # Grafana < 9 reads only this
    return grafana.dashboard.update_dashboard(payload)


def push_command(ns) -> int:
    """``ferrox grafana push``: ``ns`` has url, token, user, password, folder, dashboard.
    Returns the exit code (see the module docstring)."""
    if ns.token and (ns.user or ns.password):
        return _fail("give --token or --user/--password, not both")
    if ns.token:
        auth: Any = ns.token
    elif ns.user and ns.password is not None:
        auth = (ns.user, ns.password)
    else:
        return _fail("credentials required: --token TOKEN (a service-account token) "
                     "or --user USER --password PASSWORD")
    try:
        import requests
        from grafana_api.grafana_api import GrafanaClientError, GrafanaException
    except ImportError:
        return _fail("the grafana-api package is missing: pip install 'ferrox[grafana]'")
    url = ns.url.rstrip("/")
    try:
        board = load_dashboard(ns.dashboard)
        result = push(url, auth, board, ns.folder)
    except PushError as exc:
        return _fail(str(exc))
    except (requests.exceptions.JSONDecodeError, TypeError) as exc:  # an answer that is not Grafana's JSON
        return _fail(f"{url} did not answer like a Grafana API: {exc}")
    except requests.exceptions.Timeout:
        return _fail(f"cannot reach Grafana at {url}: no answer within {TIMEOUT_S:g} s")
    except requests.exceptions.ConnectionError as exc:
        return _fail(f"cannot reach Grafana at {url}: {_reason(exc)}")
    except requests.exceptions.RequestException as exc:
        return _fail(f"cannot talk to Grafana at {url}: {exc}")
    except GrafanaException as exc:
        code = getattr(exc, "status_code", None)
        if code in (401, 403):
            what = "rejected the credentials" if code == 401 else "denied access with these credentials"
            return _fail(f"Grafana at {url} {what} (HTTP {code}); check --token or --user/--password "
                         "(the account needs dashboard write access)")
        if code == 404:
            return _fail(f"no Grafana API at {url}/api (HTTP 404); check --url, including any path "
                         "prefix Grafana is served under")
        kind = "refused the dashboard" if isinstance(exc, GrafanaClientError) else "failed"
        return _fail(f"Grafana at {url} {kind} (HTTP {code}): {_message(exc)}")
    where = result.get("url") if isinstance(result, dict) else None
    version = result.get("version") if isinstance(result, dict) else None
    print(f"dashboard {board.get('uid')} pushed to {url}{where or ''}"
          + (f" (version {version})" if version is not None else ""))
    return 0


def _reason(exc: BaseException) -> str:
    """The innermost cause of a connection error, e.g. 'Connection refused'."""
    text = str(exc)
    for pattern in (r"\[Errno -?\d+\] ([^'\")\]]+)", r"(Name or service not known|Connection refused)"):
        m = re.search(pattern, text)
        if m:
            return m.group(1).strip()
    return type(exc).__name__


def _message(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and response.get("message"):
        return str(response["message"])
    return str(getattr(exc, "message", exc))


__all__ = ["DEFAULT_DASHBOARD", "PushError", "folder_uid", "load_dashboard", "push", "push_command"]
