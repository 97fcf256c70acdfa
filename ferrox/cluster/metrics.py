"""The cluster side's metrics: the capacity router's decisions and the ingress's HTTP answers.

Decided here:

- Router (:class:`RouterMetrics`): every ranking of a generate request
  counts one decision by ``outcome`` (``seat_fit``, ``prefix_hit``,
  ``wait``, ``fallback``; see :class:`ferrox.cluster.routing.Decision`),
  tagged with the chosen replica; the age of the chosen replica's capacity
  snapshot at that moment goes to a histogram (seconds), so operators see
  how stale the figures behind each decision were. The ``model`` tag is
  the model the replicas' snapshots name. Non-generate calls (``info``,
  probes) are not decisions and are not counted.
- Ingress (:class:`HttpMetrics`, :func:`instrument_asgi`): every HTTP
  response by ``endpoint`` (the route, so the label stays bounded) and
  ``status`` code, tagged with the model and the ingress replica.
- Both through ``ray.util.metrics`` (see :mod:`ferrox.replicas.metrics`
  for names, the ``ray_`` prefix and why), both no-ops when Ray is not
  initialised in the process and never raising into routing or serving.

Deliberately not here: engine metrics (:mod:`ferrox.replicas.metrics`),
latency at the HTTP layer (Ray Serve's own ``ray_serve_http_request_latency_ms``
has it, and the engine's histograms break it down).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Sequence

from ferrox.replicas.metrics import MetricSpec, ray_metric, ray_ready

log = logging.getLogger("ferrox.metrics")

SNAPSHOT_AGE_BUCKETS_S = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)

ROUTER_DECISIONS = MetricSpec(
    "ferrox_router_decisions", "counter",
    "Routing decisions for generate requests, by outcome (seat_fit|prefix_hit|wait|fallback) "
    "and chosen replica.",
    ("model", "replica", "outcome"))
ROUTER_SNAPSHOT_AGE = MetricSpec(
    "ferrox_router_snapshot_age_seconds", "histogram",
    "Age of the chosen replica's capacity snapshot when the router decided (seconds).",
    ("model", "replica"), SNAPSHOT_AGE_BUCKETS_S)
HTTP_REQUESTS = MetricSpec(
    "ferrox_http_requests", "counter",
    "HTTP responses of the ingress, by endpoint and status code.",
    ("model", "replica", "endpoint", "status"))

CLUSTER_METRICS: tuple[MetricSpec, ...] = (ROUTER_DECISIONS, ROUTER_SNAPSHOT_AGE, HTTP_REQUESTS)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/capacity", "/health")
"""Endpoints counted under their own path; ``/v1/models/<id>`` is ``/v1/models/{model}``,
anything else ``other``."""


class RouterMetrics:
    """The router's hook; a no-op unless :attr:`enabled`. Thread-safe as Ray's metrics are."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._model = ""
        if enabled:
            try:
                self._decisions = ray_metric(ROUTER_DECISIONS)
                self._age = ray_metric(ROUTER_SNAPSHOT_AGE)
            except Exception:
                log.warning("Ray metrics unavailable; the router records none", exc_info=True)
                self.enabled = False

    @classmethod
    def create(cls) -> "RouterMetrics":
        """Enabled iff this process is connected to Ray."""
        return cls(enabled=ray_ready())

    def decision(self, decision: Any, candidates: Sequence[Any]) -> None:
        """Count ``decision`` (a :class:`~ferrox.cluster.routing.Decision`) made over
        ``candidates`` (:class:`~ferrox.cluster.routing.Candidate`)."""
        if not self.enabled or not decision.ranking:
            return
        try:
            top = decision.ranking[0]
            age = None
            for c in candidates:
                snap = c.snapshot
                if snap is None:
                    continue
                if not self._model:
                    self._model = snap.model
                if c.replica_id == top:
                    age = c.age_s
            self._decisions.inc(1, {"model": self._model, "replica": top, "outcome": decision.outcome})
            if age is not None:
                self._age.observe(max(0.0, float(age)), {"model": self._model, "replica": top})
        except Exception:
            log.warning("recording router metrics failed; disabling them", exc_info=True)
            self.enabled = False


def endpoint_of(path: str) -> str:
    """The ``endpoint`` label for a request path (bounded: see :data:`ENDPOINTS`)."""
    if path in ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


class HttpMetrics:
    """The ingress's HTTP counter; a no-op unless :attr:`enabled`."""

    def __init__(self, model: str, replica: str, *, enabled: bool) -> None:
        self.model = model
        self.replica = replica
        self.enabled = enabled
        self._tags: dict[tuple[str, str], dict[str, str]] = {}
        if enabled:
            try:
                self._requests = ray_metric(HTTP_REQUESTS)
            except Exception:
                log.warning("Ray metrics unavailable; the ingress records none", exc_info=True)
                self.enabled = False

    @classmethod
    def create(cls, model: str, replica: str | None = None) -> "HttpMetrics":
        """Enabled iff this process is connected to Ray. ``replica`` defaults to the
        Serve replica's id (empty outside Serve)."""
        if replica is None:
            replica = ""
            try:
                from ray import serve

                replica = serve.get_replica_context().replica_id.unique_id
            except Exception:
                pass
        return cls(model, replica, enabled=ray_ready())

    def response(self, path: str, status: int) -> None:
        if not self.enabled:
            return
        try:
            key = (endpoint_of(path), str(status))
            tags = self._tags.get(key)
            if tags is None:
                tags = self._tags[key] = {"model": self.model, "replica": self.replica,
                                          "endpoint": key[0], "status": key[1]}
            self._requests.inc(1, tags)
        except Exception:
            log.warning("recording HTTP metrics failed; disabling them", exc_info=True)
            self.enabled = False


ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


def instrument_asgi(app: ASGIApp, metrics: HttpMetrics) -> ASGIApp:
    """``app`` counting each HTTP response in ``metrics`` once its status is sent.

    A request whose app raised before sending a status counts as ``500``;
    one whose client left first counts as ``499`` (nginx's convention).
    """
    if not metrics.enabled:
        return app

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        status: list[int] = []

        async def send_status(message):
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        try:
            await app(scope, receive, send_status)
        except BaseException as exc:
            metrics.response(path, status[0] if status else (499 if isinstance(exc, asyncio.CancelledError) else 500))
            raise
        metrics.response(path, status[0] if status else 500)

    return wrapped


__all__ = [
    "CLUSTER_METRICS",
    "ENDPOINTS",
    "HttpMetrics",
    "RouterMetrics",
    "endpoint_of",
    "instrument_asgi",
]
