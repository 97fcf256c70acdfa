"""The Serve replica: one engine per GPU (or per CPU share), as a Ray Serve deployment.

Decided here:

- ``generate`` is a streaming method: it yields :class:`TokenChunk` as the
  engine produces them. A request the engine refuses (bad input, never
  fits, queue full) is answered with one final chunk carrying the error and
  the HTTP status the ingress should use, not an exception, so the reason
  reaches the client intact through Ray.
- When the caller goes away (client disconnect cancels the ingress's call,
  Serve cancels this generator), the stream's ``finally`` aborts the
  request, and its pages, slot and prefix locks come back at once.
- ``record_routing_stats`` returns the engine's latest capacity snapshot; it
  never waits on the step loop. ``check_health`` fails when the engine's
  loop died, so Serve replaces the replica.

Deliberately not here: HTTP and OpenAI formats (the ingress), routing (the
router reads what this reports).
"""

from __future__ import annotations

import logging
import os
from typing import AsyncIterator

from ray import serve

from .config import EngineConfig
from .engine import LLMEngine
from .types import GenerateRequest, TokenChunk

log = logging.getLogger("ferrox.replica")


class FerroxReplica:
    """Serve deployment class wrapping one :class:`LLMEngine`."""

    def __init__(self, engine_config: dict) -> None:
        config = EngineConfig.from_dict(engine_config)
        try:
            ctx = serve.get_replica_context()
            replica_id = ctx.replica_id.unique_id
        except Exception:  # outside Serve (tests constructing it directly)
            replica_id = None
        if replica_id is not None:
            _log_through_serve()
        if config.torch_threads is None:
            # A replica's share of the machine, so replicas do not oversubscribe cores.
            config.torch_threads = max(1, int(os.environ.get("FERROX_TORCH_THREADS", "0")) or _cpu_share())
        self.engine = LLMEngine(config, replica_id=replica_id)
        self.replica_id = self.engine.replica_id
        log.info("replica %s ready: model %s, %d KV tokens", self.replica_id, self.engine.model_name,
                 self.engine.kv_pool_tokens)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        try:
            stream = self.engine.add_request(request.prompt_token_ids, request.params, request.request_id)
        except ValueError as exc:
            reason = getattr(exc, "reason", None)
            status = 503 if reason == "queue_full" else 400
            yield TokenChunk(request.request_id, finish_reason="abort", error=str(exc),
                             replica=self.replica_id, error_status=status)
            return
        except RuntimeError as exc:
            yield TokenChunk(request.request_id, finish_reason="abort", error=str(exc),
                             replica=self.replica_id, error_status=503)
            return
        try:
            async for chunk in stream:
                yield chunk
        finally:
            # Cancelled by Serve (the client went away): abort now, not when
            # the iterator is garbage-collected, so memory comes back at once.
            await stream.aclose()

    def record_routing_stats(self) -> dict:
        # Rebuilt on every call: an idle engine's last snapshot would
        # otherwise age past the router's staleness bound and lose routing
        # by capacity and prefix after a pause.
        return self.engine.refresh_snapshot().to_dict()

    async def capacity(self) -> dict:
        return self.engine.capacity_snapshot().to_dict()

    async def info(self) -> dict:
        e = self.engine
        return {
            "replica_id": e.replica_id,
            "model": e.model_name,
            "max_model_len": e.max_model_len,
            "kv_pool_tokens": e.kv_pool_tokens,
            "page_size": e.page_size,
            "vocab_size": e.vocab_size,
            "model_path": str(e.files.path),
        }

    async def check_integrity(self) -> bool:
        self.engine.check_integrity()
        return True

    def check_health(self) -> None:
        if not self.engine.healthy:
            raise RuntimeError(f"engine loop is not running: {self.engine.error!r}")

    def __del__(self) -> None:
        try:
            self.engine.shutdown()
        except Exception:
            pass


def _log_through_serve() -> None:
    """Send the ``ferrox`` loggers' records -- the engine's structured line per
    request, at INFO -- to this replica's Serve log, with Serve's handlers and
    level. Serve configures only its own ``ray.serve`` logger; without this,
    a Ray worker's root logger drops INFO."""
    serve_logger = logging.getLogger("ray.serve")
    if not serve_logger.handlers:
        return
    ferrox_logger = logging.getLogger("ferrox")
    ferrox_logger.handlers = list(serve_logger.handlers)
    ferrox_logger.setLevel(serve_logger.level or logging.INFO)
    ferrox_logger.propagate = False


def _cpu_share() -> int:
    """CPUs Ray gave this actor, at least 1."""
    try:
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0)
        if cpus >= 1:
            return int(cpus)
    except Exception:
        pass
    return 1
