"""The replica's engine: a step loop in its own thread, driven by the scheduler.

Decided here:

- One thread runs the loop, so the Serve actor's event loop stays free to
  accept requests and answer routing-stats calls: measure capacity -> the
  scheduler decides the step and allocates its pages -> the runner runs the
  forward pass and samples -> the detokenizer applies stop strings, stop
  tokens, EOS and the budget -> the scheduler releases what ended (full
  pages to the prefix cache) -> chunks go out to each request's stream.
- That same thread builds the runner (loads the weights) before the loop
  starts, so all of the engine's torch work runs in one thread. torch's
  OpenMP runtime (libgomp) keeps a worker team per thread that ever ran a
  parallel region; once the teams hold more threads than the machine has
  cores, idle workers stop spinning and sleep at once, and every parallel
  region pays a wake-up. Measured on the 2-core box: a SmolLM2 decode step
  took 6 ms longer (36 against 30 ms) when the weights had been loaded by
  another thread than the one running the loop.
- The scheduler is guarded by one lock, held for planning and committing but
  not during the forward pass. So ``add_request`` refuses a request that can
  never run synchronously, in the caller's thread, with the scheduler's own
  numbers; and ``abort`` returns every page, slot and lock at once, at any
  stage. A step in flight that included an aborted request just drops its
  token (the freed pages are not reallocated before the next plan).
- The capacity snapshot is rebuilt by the loop after each step and swapped
  in as one reference: reading it never waits for the loop.
- Every failure is the request's, not the replica's: a forward pass that
  raises ends the requests of that step with an error chunk and releases
  their memory; the loop goes on. Only if the loop itself dies does
  :attr:`LLMEngine.healthy` turn false.

Deliberately not here: HTTP, Ray, tokenizing chat messages (the ingress
does), and preemption -- an admitted request always finishes because the
scheduler reserved its whole budget at admission.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

from ferrox.scheduler.core import Scheduler, SchedulerConfig, ScheduledStep
from ferrox.scheduler.admission import RECURRENT_SLOTS_PER_REQUEST
from ferrox.scheduler.pages import CACHE_OWNER
from ferrox.scheduler.radix import SIDE_STATE, SIDE_WINDOW
from ferrox.scheduler.planner import RequestRefused

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .loader import ModelFiles, eos_token_ids, load_tokenizer, resolve_model
from .metrics import EngineMetrics
from .runner import ModelRunner
from .sampler import SamplingState
from .types import CapacitySnapshot, SamplingParams, TokenChunk, Usage

log = logging.getLogger("ferrox.engine")

_END = object()


class RequestStream:
    """The output chunks of one request, readable sync or async.

    Created by :meth:`LLMEngine.add_request`. If created inside a running
    asyncio loop it delivers through that loop (``async for``); otherwise
    through a thread-safe queue (``for``). Closing an unfinished stream
    (``aclose``/``close``, or a consumer that goes away) aborts the request.
    """

    def __init__(self, engine: "LLMEngine", request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._aq: asyncio.Queue | None = asyncio.Queue() if self._loop else None
        self._q: queue.SimpleQueue | None = None if self._loop else queue.SimpleQueue()
        self.finished = False

    def _put(self, item) -> None:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, item)  # type: ignore[union-attr]
            except RuntimeError:  # the consumer's loop is gone
                pass
        else:
            self._q.put(item)  # type: ignore[union-attr]

    def __aiter__(self) -> AsyncIterator[TokenChunk]:
        return self._agen()

    async def _agen(self) -> AsyncIterator[TokenChunk]:
        assert self._aq is not None, "this stream was created outside an event loop; iterate it with `for`"
        try:
            while (item := self._accept(await self._aq.get())) is not None:
                yield item
                if item.finished:
                    return
        finally:
            self.close()

    def __iter__(self) -> Iterator[TokenChunk]:
        assert self._q is not None, "this stream was created inside an event loop; iterate it with `async for`"
        try:
            while (item := self._accept(self._q.get())) is not None:
                yield item
                if item.finished:
                    return
        finally:
            self.close()

    def _accept(self, item) -> TokenChunk | None:
        """The next chunk to hand out, or ``None`` at the end of the stream."""
        if item is _END:
            return None
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Stop reading: an unfinished request is aborted (its memory comes back at once)."""
        if not self.finished:
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        """Async form of :meth:`close`, for callers that close async iterators with ``aclose``."""
        self.close()

    def result(self) -> TokenChunk:
        """Collect the whole output into one chunk (sync streams only)."""
        ids: list[int] = []
        text: list[str] = []
        last = None
        for chunk in self:
            ids.extend(chunk.token_ids)
            text.append(chunk.text)
            last = chunk
        assert last is not None
        return TokenChunk(self.request_id, ids, "".join(text), last.finish_reason, last.usage, last.error, last.replica)


@dataclass
class _Live:
    uid: int
    request_id: str
    stream: RequestStream
    params: SamplingParams
    prompt_len: int
    sampling: SamplingState
    detok: IncrementalDetokenizer
    arrival: float
    cached_tokens: int = 0
    first_token_at: float | None = None
    admitted_at: float | None = None
    last_token_at: float | None = None


class LLMEngine:
    """One replica's inference engine.

    ``LLMEngine(EngineConfig(...))`` loads the model (converting a GGUF once
    to a safetensors cache), sizes the pools, and starts the step loop.
    """

    def __init__(self, config: EngineConfig, *, replica_id: str | None = None, start: bool = True) -> None:
        self.config = config
        self.replica_id = replica_id or f"engine-{uuid.uuid4().hex[:8]}"
        self.files: ModelFiles = resolve_model(config.model, cache_dir=config.cache_dir)
        self.model_name = config.served_model_name or self.files.name
        self.tokenizer = load_tokenizer(self.files)
        self.eos_token_ids = set(eos_token_ids(self.files, self.tokenizer))
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=f"ferrox-engine-{self.replica_id}", daemon=True)
        self._runner_built = threading.Event()
        self._constructed = threading.Event()
        self._build_error: BaseException | None = None
        if start:
            # The loop's thread builds the runner (loading weights runs torch's
            # parallel copies), so it is the process's only OpenMP team master.
            self._thread.start()
            self._runner_built.wait()
            if self._build_error is not None:
                raise self._build_error
        else:
            self.runner = ModelRunner(config, self.files)
        try:
            self._construct(config)
        except BaseException:
            self._stop = True
            self._constructed.set()
            raise
        self._constructed.set()

    def _construct(self, config: EngineConfig) -> None:
        hf = self.files.config
        model_max = int(getattr(hf, "max_position_embeddings", 0) or 0) or 4096
        self.max_model_len = min(config.max_model_len or model_max, model_max)
        self.page_size = config.page_size
        self.vocab_size = self.runner.vocab_size
        self.scheduler = Scheduler(
            SchedulerConfig(
                page_size=config.page_size,
                num_pages=self.runner.num_pages,
                max_slots=config.max_num_seqs,
                max_prefill_tokens=config.max_prefill_tokens,
                max_model_len=self.max_model_len,
                enable_prefix_caching=config.enable_prefix_caching,
                sliding_window=self.runner.sliding_window,
                num_swa_pages=self.runner.num_swa_pages,
                recurrent=self.runner.recurrent,
                num_recurrent_slots=self.runner.num_recurrent_slots,
                max_waiting=config.max_waiting_requests,
            )
        )
        self.kv_pool_tokens = self.runner.num_pages * config.page_size
        self._lock = threading.Condition(threading.Lock())
        self._live: dict[int, _Live] = {}
        self._by_id: dict[str, int] = {}
        self._uids = itertools.count(1)
        self._seq = itertools.count(1)
        self._rate = 0.0  # decode tokens/s, exponential moving average
        self.steps = 0
        self.step_log: list[tuple[str, int, float]] | None = None  # (kind, tokens, seconds) when enabled
        self._snapshot = self._build_snapshot()
        self.metrics = EngineMetrics.for_engine(self)

    # ------------------------------------------------------------ requests
    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the field and the limit for a request that
        can never run here (the same checks :meth:`add_request` makes)."""
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty (prompt_token_ids has 0 tokens)")
        bad = [t for t in prompt_token_ids if not (0 <= int(t) < self.vocab_size)]
        if bad:
            raise ValueError(
                f"prompt_token_ids holds {len(bad)} id(s) outside the vocabulary [0, {self.vocab_size}), e.g. {bad[0]}"
            )
        params.validate()
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestRefused(
                "context_length",
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"exceeds the context length of {self.max_model_len} tokens",
                requested=total,
                limit=self.max_model_len,
            )

    def add_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request; returns its output stream.

        Raises ``ValueError`` (:class:`RequestRefused` for capacity limits,
        with ``reason``, ``requested`` and ``limit``) for a request that can
        never run, and ``RuntimeError`` if the engine is not running.
        """
        if self._error is not None or self._stop:
            raise RuntimeError(f"engine is not running: {self._error!r}")
        prompt = [int(t) for t in prompt_token_ids]
        try:
            self.validate(prompt, params)
        except ValueError:
            self.metrics.request_refused()
            raise
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        stream = RequestStream(self, request_id)
        sampling = SamplingState.create(params, prompt, self.runner.device)
        detok = IncrementalDetokenizer(self.tokenizer, prompt, params, self.eos_token_ids)
        with self._lock:
            if request_id in self._by_id:
                # Clients and proxies reuse ids (tracing headers); two live
                # requests must still be told apart here.
                request_id = f"{request_id}#{uuid.uuid4().hex[:8]}"
                stream.request_id = request_id
            uid = next(self._uids)
            try:
                self.scheduler.add_request(uid, prompt, params.max_tokens)
            except ValueError:
                self.metrics.request_refused()
                raise
            self._live[uid] = _Live(uid, request_id, stream, params, len(prompt), sampling, detok, time.monotonic())
            self._by_id[request_id] = uid
            self._snapshot = self._build_snapshot()
            self._lock.notify()
        return stream

    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> TokenChunk:
        """Blocking convenience: run one request to the end and return all of it."""
        return self.add_request(prompt_token_ids, params).result()

    def abort(self, request_id: str) -> bool:
        """End a request at any stage; its memory comes back at once. Returns
        whether it was still running. Its stream gets a final "abort" chunk."""
        with self._lock:
            uid = self._by_id.get(request_id)
            if uid is None:
                return False
            self.scheduler.abort(uid)
            live = self._live.pop(uid)
            del self._by_id[request_id]
            self._snapshot = self._build_snapshot()
        final = self._final(live, [], "", "abort")
        live.stream._put(final)
        self._log_finish(live, final, "cancelled")
        return True

    # -------------------------------------------------------------- status
    def request_phase(self, request_id: str) -> str | None:
        """Where a live request is: ``"waiting"`` (not admitted yet),
        ``"prefilling"`` (admitted, its prompt partly computed in chunks),
        ``"decoding"``; ``None`` once it ended or if it is unknown."""
        with self._lock:
            uid = self._by_id.get(request_id)
            if uid is None:
                return None
            pending = self.scheduler.planner.pending(uid)
            if pending is None:
                return "decoding"
            return "waiting" if pending.chunk is None else "prefilling"

    @property
    def healthy(self) -> bool:
        return self._error is None and not self._stop and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def capacity_snapshot(self) -> CapacitySnapshot:
        """The latest capacity snapshot; never waits on the step loop."""
        return self._snapshot

    def refresh_snapshot(self) -> CapacitySnapshot:
        with self._lock:
            self._snapshot = self._build_snapshot()
            return self._snapshot

    def _build_snapshot(self) -> CapacitySnapshot:
        s = self.scheduler
        cap = s.kv.capacity(s.planner.slots.available)
        available = cap.kv_tokens - s.planner.inflight_tokens() - s.planner.pending_kv_tokens()
        return CapacitySnapshot(
            replica_id=self.replica_id,
            seq=next(self._seq),
            timestamp=time.time(),
            model=self.model_name,
            free_slots=s.planner.slots.available,
            max_slots=s.planner.slots.capacity,
            kv_tokens_available=available,
            kv_tokens_total=self.kv_pool_tokens,
            swa_tokens_available=self._swa_available(),
            recurrent_slots_available=self._recurrent_available(),
            waiting_requests=s.planner.num_waiting_new,
            waiting_tokens=s.planner.waiting_tokens,
            running_requests=s.planner.num_running,
            page_size=self.page_size,
            max_model_len=self.max_model_len,
            prefix_digest=tuple(s.kv.cache.digest(1024)) if s.kv.enable_prefix_caching else (),
            decode_tokens_per_s=round(self._rate, 3),
            healthy=self._error is None,
        )

    def _swa_available(self) -> int | None:
        """Free (or evictable cached) window-pool tokens less what admitted window requests may still take
        (their reservation net of what they hold); ``None`` without a window pool."""
        s = self.scheduler
        if s.kv.sliding_window is None:
            return None
        outstanding = sum(
            max(reserve - s.kv.window_held(uid), 0) for uid, reserve in s.planner._window_reserve.items()
        )
        cap = s.kv.capacity(0)  # free + cached window pages no request uses
        return cap.swa_tokens - outstanding

    def _recurrent_available(self) -> int | None:
        """Free (or evictable cached) recurrent slots less three per request still waiting; ``None`` without the pool."""
        s = self.scheduler
        if not s.kv.recurrent.num_pages:
            return None
        cap = s.kv.capacity(0)  # free + cached snapshots no request uses
        return cap.recurrent_slots - RECURRENT_SLOTS_PER_REQUEST * s.planner.num_waiting_new

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless every page, slot and lock is accounted for."""
        with self._lock:
            self.scheduler.check_integrity()
            if set(self._live) != set(self.scheduler._reqs):
                raise AssertionError("engine and scheduler disagree on live requests")

    def check_idle(self) -> None:
        """Raise ``AssertionError`` unless no request is live and every page is
        free or in the prefix cache unlocked, every slot free (tests, after an abort)."""
        with self._lock:
            if self._live:
                raise AssertionError(f"{len(self._live)} request(s) still live")
            self.scheduler.check_integrity()
            self.scheduler.kv.check_idle()
            slots = self.scheduler.planner.slots
            if slots.available != slots.capacity:
                raise AssertionError(f"{slots.capacity - slots.available} request slot(s) still held")

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix no running request uses (its pages, window
        pages and snapshots go back to their pools), as vLLM's
        ``reset_prefix_cache``. Returns whether the cache is now empty (it is
        not while requests hold cached prefixes)."""
        with self._lock:
            kv = self.scheduler.kv
            kv.pages.free(kv.cache.evict(kv.cache.num_pages), CACHE_OWNER)
            for kind, pool in ((SIDE_WINDOW, kv.swa_pages), (SIDE_STATE, kv.recurrent)):
                pool.free(kv.cache.evict_side(kind, kv.cache.side_count(kind)), CACHE_OWNER)
            return kv.cache.num_pages == 0

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until no request is live (tests and benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._live:
                    return True
            time.sleep(0.005)
        return False

    def shutdown(self) -> None:
        """Stop the loop; unfinished requests end with "abort"."""
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        with self._lock:
            lives = list(self._live.values())
            for live in lives:
                self.scheduler.abort(live.uid)
            self._live.clear()
            self._by_id.clear()
        for live in lives:
            live.stream._put(self._final(live, [], "", "abort", error="engine shut down"))

    # ---------------------------------------------------------------- loop
    def _main(self) -> None:
        """The loop thread: build the runner, wait for the rest of the engine, run the loop."""
        try:
            self.runner = ModelRunner(self.config, self.files)
        except BaseException as exc:
            self._build_error = exc
            return
        finally:
            self._runner_built.set()
        self._constructed.wait()
        if not self._stop:
            self._run()

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    step = None
                    while not self._stop:
                        step = self.scheduler.schedule()
                        if step is not None:
                            break
                        self.metrics.idle()
                        self._lock.wait(timeout=0.5)
                    if self._stop:
                        return
                    assert step is not None
                    states = {s.uid: self._live[s.uid].sampling for s in step.seqs if s.samples and s.uid in self._live}
                    now = time.monotonic()
                    admitted = []
                    for s in step.seqs:
                        if s.admission is not None and s.uid in self._live:
                            self._live[s.uid].cached_tokens = s.admission[1]
                            self._live[s.uid].admitted_at = now
                            admitted.append((s.admission[0], s.admission[1], now - self._live[s.uid].arrival))
                step_t0 = time.perf_counter()
                self.metrics.admitted(admitted)
                try:
                    out = self.runner.execute(step, states)
                except Exception as exc:  # the step's requests fail, the replica goes on
                    log.exception("forward pass failed; failing %d request(s)", len(step.seqs))
                    self._fail_step(step, exc)
                    continue
                self._finish_step(step, out.sampled, out.forward_s)
                self.metrics.step(step, time.perf_counter() - step_t0)
        except BaseException as exc:  # pragma: no cover - the loop itself broke
            log.exception("engine loop died")
            self._error = exc
            with self._lock:
                lives = list(self._live.values())
                self._live.clear()
                self._by_id.clear()
            for live in lives:
                live.stream._put(self._final(live, [], "", "abort", error=f"engine failed: {exc!r}"))

    def _fail_step(self, step: ScheduledStep, exc: Exception) -> None:
        with self._lock:
            failed = []
            for s in step.seqs:
                live = self._live.pop(s.uid, None)
                if live is None:
                    continue
                self.scheduler.abort(s.uid)
                self._by_id.pop(live.request_id, None)
                failed.append(live)
            self._snapshot = self._build_snapshot()
        for live in failed:
            final = self._final(live, [], "", "abort", error=f"forward pass failed: {exc}")
            live.stream._put(final)
            self._log_finish(live, final, "error")

    def _finish_step(self, step: ScheduledStep, sampled: dict[int, int], forward_s: float) -> None:
        emits: list[tuple[_Live, TokenChunk]] = []
        ttfts: list[float] = []
        itls: list[float] = []
        now = time.monotonic()
        with self._lock:
            stopped: list[int] = []
            for s in step.seqs:
                live = self._live.get(s.uid)
                if live is None or s.uid not in sampled:
                    continue
                token = sampled[s.uid]
                live.sampling.output_token_ids.append(token)
                out = live.detok.append([token])
                if live.first_token_at is None:
                    live.first_token_at = now
                    ttfts.append(now - live.arrival)
                else:
                    itls.append(now - live.last_token_at)
                live.last_token_at = now
                if out.finish_reason is not None:
                    stopped.append(s.uid)
                    emits.append((live, self._final(live, out.token_ids, out.text, out.finish_reason.value)))
                elif out.token_ids or out.text:
                    emits.append((live, TokenChunk(live.request_id, out.token_ids, out.text, replica=self.replica_id)))
            released = self.scheduler.commit(step, sampled, stopped)
            for uid in released:
                live = self._live.pop(uid, None)
                if live is not None:
                    self._by_id.pop(live.request_id, None)
                    if uid not in stopped:  # pragma: no cover - budget and detokenizer agree
                        emits.append((live, self._final(live, [], "", "length")))
            if step.kind == "decode" and forward_s > 0:
                rate = len(step.seqs) / forward_s
                self._rate = rate if self._rate == 0 else 0.8 * self._rate + 0.2 * rate
            self.steps += 1
            if self.step_log is not None:
                self.step_log.append((step.kind, step.num_tokens, forward_s))
            self._snapshot = self._build_snapshot()
        self.metrics.tokens(ttfts, itls)
        for live, chunk in emits:
            live.stream._put(chunk)
            if chunk.finished:
                self._log_finish(live, chunk)

    def _final(self, live: _Live, token_ids, text: str, reason: str, error: str | None = None) -> TokenChunk:
        usage = Usage(live.prompt_len, live.detok.num_output_tokens, live.cached_tokens)
        return TokenChunk(live.request_id, list(token_ids), text, reason, usage, error, self.replica_id)  # type: ignore[arg-type]

    def _log_finish(self, live: _Live, chunk: TokenChunk, status: str | None = None) -> None:
        """The request's one structured INFO line, and its end in the metrics.
        ``status``: ok | cancelled | error (default: error iff the chunk carries one)."""
        now = time.monotonic()
        status = status or ("error" if chunk.error else "ok")
        ttft = (live.first_token_at - live.arrival) if live.first_token_at else float("nan")
        queue = (live.admitted_at - live.arrival) if live.admitted_at else float("nan")
        self.metrics.finished(chunk.finish_reason or "abort", status, now - live.arrival, live.prompt_len,
                              live.detok.num_output_tokens)
        log.info(
            "request_id=%s replica=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d "
            "queue_s=%.4f ttft_s=%.4f e2e_s=%.4f finish_reason=%s status=%s",
            live.request_id, self.replica_id, live.prompt_len, live.cached_tokens,
            live.detok.num_output_tokens, queue, ttft, now - live.arrival, chunk.finish_reason, status,
        )
