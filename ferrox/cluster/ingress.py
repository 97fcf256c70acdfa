"""The ingress deployment: OpenAI HTTP in, token streams from the replicas out.

Decided here: how the OpenAI layer (``openai_app.py``, independent of Ray)
reaches the replicas through a Serve :class:`DeploymentHandle`:

- ``generate`` streams from ``FerroxReplica.generate`` through the handle,
  whose router (``router.py``) picks the replica from the request's needs.
  A replica's refusal (a final chunk with ``error_status``) before any token
  becomes an :class:`OpenAIError` with that status. A replica that fails
  mid-stream ends the stream with an error chunk, never a hang. Closing the
  stream early (client disconnect) cancels the replica call, which aborts
  the request there and frees its memory. A cancellation of the replica
  call (Serve cancels it when the client goes away) is re-raised as it is,
  not reported as a failed replica: the OpenAI layer logs it at INFO.
- Request bodies over ``max_request_bytes`` (``IngressArgs``) get 413.
- Waiting work is bounded: more than ``max_waiting_requests`` requests in
  flight through this ingress replica get 503 with ``Retry-After``.
- Health and capacity ask every replica actor of the app directly (Serve's
  handle reaches one replica per call; operators need all of them).

Deliberately not here: request validation and OpenAI formats (``openai_app``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from ferrox.replicas.loader import load_tokenizer, resolve_model
from ferrox.replicas.types import GenerateRequest, TokenChunk

from .config import IngressArgs
from .errors import OpenAIError, is_cancellation
from .metrics import HttpMetrics, instrument_asgi
from .openai_app import create_app

log = logging.getLogger("ferrox.ingress")

_REPLICA_PREFIX = "SERVE_REPLICA::"


class ServeBackend:
    """The :class:`~ferrox.cluster.openai_app.Backend` over a Serve handle."""

    def __init__(self, handle: DeploymentHandle, info: dict, tokenizer, max_waiting: int,
                 app_name: str, replica_deployment: str) -> None:
        self.handle = handle
        self.model_name = info["model"]
        self.max_model_len = int(info["max_model_len"])
        self.page_size = int(info["page_size"])
        self.kv_pool_tokens = int(info["kv_pool_tokens"])
        self.tokenizer = tokenizer
        self.default_max_tokens = None
        self.max_waiting = max_waiting
        self.inflight = 0
        self.app_name = app_name
        self.replica_deployment = replica_deployment

    def max_seatable_tokens(self) -> int:
        return self.kv_pool_tokens

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        if self.inflight >= self.max_waiting:
            raise OpenAIError(
                503,
                f"the server has {self.inflight} requests in flight (limit {self.max_waiting}); retry later",
                type="overloaded_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        self.inflight += 1
        gen = self.handle.options(stream=True).generate.remote(request)
        finished = False
        produced = False
        try:
            try:
                async for chunk in gen:
                    if chunk.error is not None and not produced and chunk.error_status is not None:
                        finished = True
                        status = chunk.error_status
                        raise OpenAIError(
                            status,
                            chunk.error,
                            type="overloaded_error" if status == 503 else "invalid_request_error",
                            code="overloaded" if status == 503 else "context_length_exceeded"
                            if "context" in chunk.error or "KV pool" in chunk.error else None,
                            headers={"Retry-After": "1"} if status == 503 else None,
                        )
                    produced = produced or bool(chunk.token_ids)
                    if chunk.finished:
                        finished = True
                    yield chunk
            except OpenAIError:
                raise
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as exc:  # the replica died or the call failed mid-stream
                if is_cancellation(exc):  # the client went away: Serve cancelled the call
                    raise
                log.warning("request %s failed in its replica: %r", request.request_id, exc)
                finished = True
                yield TokenChunk(request.request_id, finish_reason="abort",
                                 error=f"the replica serving this request failed: {type(exc).__name__}")
        finally:
            self.inflight -= 1
            if not finished:
                gen.cancel()

    def _replica_actors(self) -> list:
        prefix = f"{_REPLICA_PREFIX}{self.app_name}#{self.replica_deployment}#"
        actors = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name = entry["name"] if isinstance(entry, dict) else entry
            namespace = entry.get("namespace", "serve") if isinstance(entry, dict) else "serve"
            if name.startswith(prefix):
                try:
                    actors.append(ray.get_actor(name, namespace=namespace))
                except ValueError:
                    pass
        return actors

    async def healthy(self) -> bool:
        actors = self._replica_actors()
        if not actors:
            return False
        try:
            await asyncio.wait_for(asyncio.gather(*[a.check_health.remote() for a in actors]), timeout=10)
        except Exception:
            return False
        return True

    async def capacity(self) -> list[dict]:
        actors = self._replica_actors()
        results = await asyncio.gather(
            *[a.record_routing_stats.remote() for a in actors], return_exceptions=True
        )
        return sorted((r for r in results if isinstance(r, dict) and r), key=lambda d: d.get("replica_id", ""))


@serve.ingress()
class FerroxIngress:
    """Serve ingress deployment class; its ASGI app is built per replica."""

    async def __init__(self, replica: DeploymentHandle, max_waiting_requests: int = 1024,
                       replica_deployment: str = "FerroxReplica",
                       max_request_bytes: int = IngressArgs.model_fields["max_request_bytes"].default) -> None:
        info = await replica.info.remote()
        files = resolve_model(info["model_path"])
        tokenizer = load_tokenizer(files)
        try:
            app_name = serve.get_replica_context().app_name
        except Exception:
            app_name = ""
        self.backend = ServeBackend(replica, info, tokenizer, max_waiting_requests, app_name, replica_deployment)
        self.max_request_bytes = max_request_bytes

    def __serve_build_asgi_app__(self):
        app = _without_own_request_id(create_app(self.backend, max_request_bytes=self.max_request_bytes))
        # Each response counted by endpoint and status (ray_ferrox_http_requests_total).
        return instrument_asgi(app, HttpMetrics.create(self.backend.model_name))


def _without_own_request_id(app):
    """Serve's proxy already answers with ``x-request-id`` (its own request id,
    which it also hands the app as the incoming header, so the app uses the
    same value). Drop the app's copy so clients see the header once."""
    header = b"x-request-id"

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_once(message):
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [(k, v) for k, v in message.get("headers", []) if k.lower() != header]
            await send(message)

        return await app(scope, receive, send_once)

    return wrapped
