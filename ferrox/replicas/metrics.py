"""The engine's metrics: what a replica reports to Ray's Prometheus endpoint.

Decided here:

- The metric set a replica exports and its names, tags and buckets
  (:data:`ENGINE_METRICS`): requests by ``finish_reason`` and ``status``;
  time to first token, inter-token latency, end-to-end latency and queue
  time (seconds); prompt, cached-prompt and generation tokens; running and
  waiting requests; use of each memory pool (KV, window, recurrent);
  the prefix cache; admission refusals by ``NotAdmitted`` reason; step time,
  batch size and tokens by step kind. Every series carries ``model`` and
  ``replica`` tags. Names start with ``ferrox_``; Ray's exporter prefixes
  ``ray_`` and gives counters a ``_total`` suffix
  (:attr:`MetricSpec.prometheus_name`).
- Through ``ray.util.metrics``, so the figures appear on each Ray node's
  metrics export port and in the Ray dashboard, with no second exporter.
- :class:`EngineMetrics` is the engine's only contact with them: a handful of
  calls per step and per request, each a no-op when Ray is not initialised
  in this process (offline ``ferrox generate``, unit tests), and never
  raising into the engine: a metrics failure disables metrics, not serving.
- Cost: per step, three histogram observations, at most two counter
  increments and (at most every :data:`STATE_PERIOD_S`) about eight gauge
  sets; per produced token, one inter-token-latency observation (Ray's
  recorder takes about 5 us per call); per request, a few observations at
  admission, first token and finish.

Definitions, for whoever reads the dashboard:

- time to first token: the engine received the request -> its first token
  was sampled (tokenizing and routing happen before, in the ingress);
- queue time: received -> its first prefill chunk was scheduled;
- inter-token latency: between two consecutive tokens of one request;
- end-to-end latency: received -> its last chunk was produced;
- pool use: tokens (slots, for the recurrent pool) that running requests
  hold or have reserved for their remaining budget, over the pool's size.
  Unlocked prefix-cache pages are not in use: admission may evict them.

Deliberately not here: exporting (Ray does), HTTP and router metrics
(:mod:`ferrox.cluster.metrics`), and exact histogram sums: Ray's exporter
rebuilds each histogram from its bucket counts and reports ``_sum`` from
bucket midpoints, so means read from ``_sum / _count`` are approximate;
``_count`` and the counters are exact.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from ferrox.scheduler.core import ScheduledStep

    from .engine import LLMEngine

log = logging.getLogger("ferrox.metrics")

STATE_PERIOD_S = 0.05
"""At most this often (seconds) the step loop re-publishes the pool and queue gauges;
an idle engine publishes on every idle wake-up (at least every 0.5 s)."""


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its ``ray.util.metrics`` name, kind, tag keys and buckets.

    ``kind``: ``"counter"``, ``"gauge"`` or ``"histogram"``. ``buckets``:
    histogram upper bounds, increasing, in the metric's unit.
    """

    name: str
    kind: str
    description: str
    tags: tuple[str, ...]
    buckets: tuple[float, ...] = ()

    @property
    def prometheus_name(self) -> str:
        """The name Prometheus sees: ``ray_`` + name (+ ``_total`` for a counter).
        A histogram's series add ``_bucket``, ``_count`` and ``_sum`` to it."""
        return "ray_" + self.name + ("_total" if self.kind == "counter" else "")


_TAGS = ("model", "replica")

# Buckets for a serving system between a small CPU replica (tens of ms per
# step) and a large GPU one; the tails reach minutes for long generations.
TTFT_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                  2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS_S = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
                 90.0, 120.0, 180.0, 300.0, 600.0, 1200.0)
QUEUE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0, 160.0, 320.0)
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                  0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024)
REQUEST_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536,
                         131072)

REQUESTS = MetricSpec(
    "ferrox_requests", "counter",
    "Requests that ended, by finish_reason (stop|length|abort) and status "
    "(ok|cancelled|error|refused: refused ones never started).",
    _TAGS + ("finish_reason", "status"))
TTFT = MetricSpec(
    "ferrox_time_to_first_token_seconds", "histogram",
    "Seconds from the engine receiving a request to its first token.", _TAGS, TTFT_BUCKETS_S)
ITL = MetricSpec(
    "ferrox_inter_token_latency_seconds", "histogram",
    "Seconds between two consecutive output tokens of one request.", _TAGS, ITL_BUCKETS_S)
E2E = MetricSpec(
    "ferrox_e2e_request_latency_seconds", "histogram",
    "Seconds from the engine receiving a request to its end (any finish_reason).", _TAGS, E2E_BUCKETS_S)
QUEUE = MetricSpec(
    "ferrox_request_queue_time_seconds", "histogram",
    "Seconds a request waited before its first prefill chunk was scheduled.", _TAGS, QUEUE_BUCKETS_S)
REQUEST_PROMPT_TOKENS = MetricSpec(
    "ferrox_request_prompt_tokens", "histogram",
    "Prompt tokens per finished request.", _TAGS, REQUEST_TOKEN_BUCKETS)
REQUEST_GENERATION_TOKENS = MetricSpec(
    "ferrox_request_generation_tokens", "histogram",
    "Output tokens per finished request.", _TAGS, REQUEST_TOKEN_BUCKETS)
PROMPT_TOKENS = MetricSpec(
    "ferrox_prompt_tokens", "counter", "Prompt tokens of admitted requests.", _TAGS)
CACHED_PROMPT_TOKENS = MetricSpec(
    "ferrox_cached_prompt_tokens", "counter",
    "Prompt tokens of admitted requests found in the prefix cache (not recomputed).", _TAGS)
GENERATION_TOKENS = MetricSpec(
    "ferrox_generation_tokens", "counter", "Output tokens sampled.", _TAGS)
RUNNING = MetricSpec(
    "ferrox_running_requests", "gauge", "Requests holding a slot (prefilling or decoding).", _TAGS)
WAITING = MetricSpec(
    "ferrox_waiting_requests", "gauge", "Requests queued, not yet admitted.", _TAGS)
POOL_USAGE = MetricSpec(
    "ferrox_pool_usage_ratio", "gauge",
    "Fraction of a memory pool (pool=kv|window|recurrent) held or reserved by running requests.",
    _TAGS + ("pool",))
POOL_USED = MetricSpec(
    "ferrox_pool_used", "gauge",
    "Pool units held or reserved by running requests: tokens (kv, window) or state slots (recurrent).",
    _TAGS + ("pool",))
POOL_CAPACITY = MetricSpec(
    "ferrox_pool_capacity", "gauge",
    "Pool size: tokens (kv, window) or state slots (recurrent).", _TAGS + ("pool",))
PREFIX_CACHE_TOKENS = MetricSpec(
    "ferrox_prefix_cache_tokens", "gauge", "Tokens held by the radix prefix cache (locked or not).", _TAGS)
PREFIX_CACHE_HIT_RATIO = MetricSpec(
    "ferrox_prefix_cache_hit_ratio", "gauge",
    "Cached prompt tokens over prompt tokens admitted since the replica started.", _TAGS)
ADMISSION_REFUSALS = MetricSpec(
    "ferrox_admission_refusals", "counter",
    "Steps whose admission pass left a waiting request out, by NotAdmitted reason.",
    _TAGS + ("reason",))
STEP_DURATION = MetricSpec(
    "ferrox_step_duration_seconds", "histogram",
    "Engine step wall time, plan to committed output (forward pass, sampling, detokenizing), by kind.",
    _TAGS + ("kind",), STEP_BUCKETS_S)
STEP_BATCH = MetricSpec(
    "ferrox_step_batch_size", "histogram", "Sequences per engine step, by kind.",
    _TAGS + ("kind",), BATCH_BUCKETS)
STEP_TOKENS = MetricSpec(
    "ferrox_step_tokens", "counter",
    "Tokens computed by engine steps (prefill chunks, decode positions), by kind.", _TAGS + ("kind",))

ENGINE_METRICS: tuple[MetricSpec, ...] = (
    REQUESTS, TTFT, ITL, E2E, QUEUE, REQUEST_PROMPT_TOKENS, REQUEST_GENERATION_TOKENS,
    PROMPT_TOKENS, CACHED_PROMPT_TOKENS, GENERATION_TOKENS, RUNNING, WAITING,
    POOL_USAGE, POOL_USED, POOL_CAPACITY, PREFIX_CACHE_TOKENS, PREFIX_CACHE_HIT_RATIO,
    ADMISSION_REFUSALS, STEP_DURATION, STEP_BATCH, STEP_TOKENS,
)

_created: dict[str, Any] = {}
_created_lock = threading.Lock()


def ray_ready() -> bool:
    """Whether this process is connected to Ray, so ``ray.util.metrics`` can record.
    Never imports Ray: a process that has not imported it is not connected."""
    ray = sys.modules.get("ray")
    try:
        return ray is not None and bool(ray.is_initialized())
    except Exception:
        return False


def ray_metric(spec: MetricSpec):
    """The process's ``ray.util.metrics`` object for ``spec``, created once.

    Requires :func:`ray_ready`; raises whatever Ray raises otherwise."""
    with _created_lock:
        metric = _created.get(spec.name)
        if metric is None:
            from ray.util import metrics as rm

            if spec.kind == "counter":
                metric = rm.Counter(spec.name, spec.description, spec.tags)
            elif spec.kind == "gauge":
                metric = rm.Gauge(spec.name, spec.description, spec.tags)
            elif spec.kind == "histogram":
                metric = rm.Histogram(spec.name, spec.description, list(spec.buckets), spec.tags)
            else:  # pragma: no cover - the specs above are the only ones
                raise ValueError(f"unknown metric kind {spec.kind!r}")
            _created[spec.name] = metric
        return metric


class EngineMetrics:
    """The engine's metrics hooks; every hook is a no-op when :attr:`enabled` is false.

    Made by :meth:`for_engine`. Hooks are called by the engine's step-loop
    thread, except :meth:`request_refused` and :meth:`finished` for aborts,
    which run in the caller's thread. A hook that raises disables the
    object (logged once) and returns.
    """

    def __init__(self, model: str, replica: str, engine: "LLMEngine | None" = None, *, enabled: bool) -> None:
        self.model = model
        self.replica = replica
        self.enabled = enabled
        self._engine = engine
        self._prompt_total = 0
        self._cached_total = 0
        self._state_at = 0.0
        if not enabled:
            return
        try:
            self._m = {spec.name: ray_metric(spec) for spec in ENGINE_METRICS}
        except Exception:
            log.warning("Ray metrics unavailable; this engine records none", exc_info=True)
            self.enabled = False
            return
        base = {"model": model, "replica": replica}
        self._tags = base
        self._kind_tags = {k: {**base, "kind": k} for k in ("prefill", "decode")}
        self._pool_tags = {p: {**base, "pool": p} for p in ("kv", "window", "recurrent")}
        self._reason_tags: dict[str, dict[str, str]] = {}
        self._end_tags: dict[tuple[str, str], dict[str, str]] = {}

    @classmethod
    def for_engine(cls, engine: "LLMEngine") -> "EngineMetrics":
        """Metrics for ``engine`` (its ``model_name`` and ``replica_id`` as tags);
        enabled iff this process is connected to Ray."""
        return cls(engine.model_name, engine.replica_id, engine, enabled=ray_ready())

    def _failed(self) -> None:
        log.warning("recording engine metrics failed; disabling them for replica %s", self.replica,
                    exc_info=True)
        self.enabled = False

    # ------------------------------------------------------------ requests
    def request_refused(self) -> None:
        """A request was refused before it started (never fits, queue full, bad input)."""
        if not self.enabled:
            return
        try:
            self._m[REQUESTS.name].inc(1, self._end("abort", "refused"))
        except Exception:
            self._failed()

    def admitted(self, requests: Sequence[tuple[int, int, float]]) -> None:
        """Requests whose first prefill chunk this step schedules:
        ``(prompt_tokens, cached_tokens, queue_seconds)`` each."""
        if not self.enabled or not requests:
            return
        try:
            prompt = sum(r[0] for r in requests)
            cached = sum(r[1] for r in requests)
            self._prompt_total += prompt
            self._cached_total += cached
            t = self._tags
            self._m[PROMPT_TOKENS.name].inc(prompt, t)
            if cached:
                self._m[CACHED_PROMPT_TOKENS.name].inc(cached, t)
            queue = self._m[QUEUE.name]
            for r in requests:
                queue.observe(max(0.0, r[2]), t)
        except Exception:
            self._failed()

    def tokens(self, ttft_s: Sequence[float], itl_s: Sequence[float]) -> None:
        """Tokens a step produced: a time to first token for each request's
        first, an inter-token latency for every later one (seconds)."""
        n = len(ttft_s) + len(itl_s)
        if not self.enabled or n == 0:
            return
        try:
            t = self._tags
            self._m[GENERATION_TOKENS.name].inc(n, t)
            ttft = self._m[TTFT.name]
            for v in ttft_s:
                ttft.observe(v, t)
            itl = self._m[ITL.name]
            for v in itl_s:
                itl.observe(v, t)
        except Exception:
            self._failed()

    def finished(self, finish_reason: str, status: str, e2e_s: float, prompt_tokens: int,
                 completion_tokens: int) -> None:
        """A started request ended. ``status``: ``"ok"`` (stop or length),
        ``"cancelled"`` (aborted by its caller) or ``"error"``."""
        if not self.enabled:
            return
        try:
            t = self._tags
            self._m[REQUESTS.name].inc(1, self._end(finish_reason or "abort", status))
            self._m[E2E.name].observe(max(0.0, e2e_s), t)
            if status == "ok":
                self._m[REQUEST_PROMPT_TOKENS.name].observe(prompt_tokens, t)
                self._m[REQUEST_GENERATION_TOKENS.name].observe(completion_tokens, t)
        except Exception:
            self._failed()

    def _end(self, finish_reason: str, status: str) -> dict[str, str]:
        key = (finish_reason, status)
        tags = self._end_tags.get(key)
        if tags is None:
            tags = self._end_tags[key] = {**self._tags, "finish_reason": finish_reason, "status": status}
        return tags

    # ---------------------------------------------------------------- steps
    def step(self, step: "ScheduledStep", seconds: float) -> None:
        """One step ran (``seconds`` of wall time); its admission refusal, if any, is counted."""
        if not self.enabled:
            return
        try:
            tags = self._kind_tags.get(step.kind) or {**self._tags, "kind": step.kind}
            self._m[STEP_DURATION.name].observe(max(0.0, seconds), tags)
            self._m[STEP_BATCH.name].observe(len(step.seqs), tags)
            tokens = step.num_tokens
            if tokens:
                self._m[STEP_TOKENS.name].inc(tokens, tags)
            if step.blocked is not None:
                reason = getattr(step.blocked, "value", str(step.blocked))
                rt = self._reason_tags.get(reason)
                if rt is None:
                    rt = self._reason_tags[reason] = {**self._tags, "reason": reason}
                self._m[ADMISSION_REFUSALS.name].inc(1, rt)
            now = time.monotonic()
            if now - self._state_at >= STATE_PERIOD_S:
                self._state_at = now
                self._publish_state()
        except Exception:
            self._failed()

    def idle(self) -> None:
        """The step loop found nothing to run: publish the settled queue and pool state."""
        if not self.enabled:
            return
        try:
            self._state_at = time.monotonic()
            self._publish_state()
        except Exception:
            self._failed()

    def _publish_state(self) -> None:
        engine = self._engine
        if engine is None:
            return
        snap = engine.capacity_snapshot()
        m, t = self._m, self._tags
        m[RUNNING.name].set(snap.running_requests, t)
        m[WAITING.name].set(snap.waiting_requests, t)
        # The snapshot's available KV is free + evictable less what running
        # requests may still consume and what the waiting queue will reserve;
        # adding the queue's share back leaves what running requests hold or
        # have reserved.
        total = snap.kv_tokens_total
        used = min(total, max(0, total - snap.kv_tokens_available - snap.waiting_tokens))
        self._pool("kv", used, total)
        kv = engine.scheduler.kv
        if kv.swa_pages.num_pages:
            size = kv.swa_pages.num_pages * kv.page_size
            self._pool("window", size - kv.swa_pages.num_free * kv.page_size, size)
        if kv.recurrent.num_pages:
            self._pool("recurrent", kv.recurrent.num_pages - kv.recurrent.num_free, kv.recurrent.num_pages)
        m[PREFIX_CACHE_TOKENS.name].set(kv.cache.cached_tokens, t)
        if self._prompt_total:
            m[PREFIX_CACHE_HIT_RATIO.name].set(self._cached_total / self._prompt_total, t)

    def _pool(self, pool: str, used: int, size: int) -> None:
        tags = self._pool_tags[pool]
        self._m[POOL_USED.name].set(used, tags)
        self._m[POOL_CAPACITY.name].set(size, tags)
        self._m[POOL_USAGE.name].set(used / size if size else 0.0, tags)


__all__ = [
    "ENGINE_METRICS",
    "EngineMetrics",
    "MetricSpec",
    "STATE_PERIOD_S",
    "ray_metric",
    "ray_ready",
]
