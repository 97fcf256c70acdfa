"""Trace simulator: the scheduler driven exactly as the engine drives it, with no model.

Decided here: what a replica's scheduler does with a trace of arrivals --
which step admits each request, when its first and last tokens come, why it
finished, what the prefix cache saved -- and what each step runs. The
simulator makes the engine's calls in the engine's order
(``add_request`` / ``abort`` between steps, then
:meth:`~ferrox.scheduler.core.Scheduler.schedule`, a fake forward pass, then
:meth:`~ferrox.scheduler.core.Scheduler.commit` with the sampled tokens and
the requests that stopped early), so it exercises the code that serves, not
a model of it. After every step it checks the scheduler's integrity and the
contracts the engine relies on (each sequence's query tokens, positions and
page tables; a prompt reported once); a broken one raises ``AssertionError``
there, at the step that broke it.

Why: capacity questions ("how long does a 4,000-token prompt wait behind 200
decoders on 8,000 pages?") and scheduler bugs are both arithmetic, and both
are far cheaper to answer over token ids than on a GPU. Tests use it to
replay bug reports and random traces; capacity planning uses it with a
:class:`CostModel` fitted to measured step times.

Time is counted in two clocks. ``step`` is the index of a scheduler call
(arrivals and aborts are given in it, so a trace replays identically
whatever the cost model says); ``time`` is seconds under the cost model, the
sum of the costs of the steps run so far. A step with nothing to run costs
nothing; when no request is live the simulator jumps straight to the next
arrival's step.

Deliberately not here: sampling (tokens are a deterministic function of
request and position, :func:`fake_token`), stop strings (an early stop is
given per arrival as the output token that ends the turn), and any notion
of the router or of more than one replica.

Run ``python -m ferrox.scheduler.simulator --help`` for a synthetic trace's
summary.
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from .admission import align_ceil
from .core import ScheduledStep, Scheduler, SchedulerConfig
from .planner import RequestRefused

#: Sampled token ids (:func:`fake_token`) stay below this.
VOCAB = 1 << 30


def prompt_tokens(uid: int, length: int, prefix: Sequence[int] = ()) -> tuple[int, ...]:
    """A prompt of ``length`` token ids: ``prefix`` (cut to ``length``), then
    ids unique to ``uid`` (``(uid + 1) * 1_000_003 + i``; unique across uids
    >= 0 for prompts under a million tokens).

    So two prompts share a cached prefix exactly when they share ``prefix``.
    """
    prefix = tuple(prefix[:length])
    base = (uid + 1) * 1_000_003
    return prefix + tuple(base + i for i in range(length - len(prefix)))


def fake_token(uid: int, index: int) -> int:
    """The token "sampled" as output number ``index`` (0-based) of request ``uid``.

    Deterministic, so a replayed trace samples the same tokens.
    """
    return (uid * 2_654_435_761 + index * 40_503 + 7) % VOCAB


@dataclass(frozen=True)
class Arrival:
    """One request of a trace.

    ``step``: the scheduler call before which it arrives. ``prompt``: token
    ids, or a length (then :func:`prompt_tokens` makes ids unique to the
    uid). ``output_len``: ``max_tokens``. ``stop_after``: the request ends
    itself (EOS, stop string) with its ``stop_after``-th output token, when
    that comes before the budget runs out. ``abort_step``: the client goes
    away before that scheduler call, or on arrival if that is later (ignored
    once the request has ended).
    """

    uid: int
    step: int
    prompt: tuple[int, ...] | int
    output_len: int
    stop_after: int | None = None
    abort_step: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.prompt, int):
            object.__setattr__(self, "prompt", prompt_tokens(self.uid, self.prompt))
        else:
            object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        if self.step < 0:
            raise ValueError(f"arrival step must be >= 0, got {self.step}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"stop_after must be >= 1, got {self.stop_after}")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)  # type: ignore[arg-type]


@dataclass(frozen=True)
class CostModel:
    """Seconds one step takes: ``step_overhead_s`` plus ``prefill_token_s``
    per prefill token and ``decode_seq_s`` per decoding sequence.

    The defaults are round numbers of the order of a small model on one GPU,
    not a measurement; fit them to a replica's step log (the engine records
    ``(kind, tokens, seconds)`` per step) before reading absolute times.
    """

    prefill_token_s: float = 5e-5
    decode_seq_s: float = 2e-4
    step_overhead_s: float = 5e-3

    def step_seconds(self, kind: str, num_tokens: int, batch_size: int) -> float:
        if kind == "prefill":
            return self.step_overhead_s + self.prefill_token_s * num_tokens
        if kind == "decode":
            return self.step_overhead_s + self.decode_seq_s * batch_size
        return 0.0


@dataclass
class RequestResult:
    """What happened to one arrival. Steps are scheduler-call indices, times
    seconds under the cost model; ``None`` where the event never happened.

    ``finish_reason``: ``"stop"``, ``"length"``, ``"abort"``, or
    ``"refused"`` (then ``refused`` holds :attr:`RequestRefused.reason`).
    ``cached_tokens``: the prefix hit reported at admission.
    """

    uid: int
    prompt_len: int
    output_len: int
    arrival_step: int
    arrival_time: float
    admission_step: int | None = None
    cached_tokens: int | None = None
    first_token_step: int | None = None
    first_token_time: float | None = None
    finish_step: int | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    output_tokens: int = 0
    refused: str | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the end of the step that sampled the first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class StepRecord:
    """One scheduler call: ``kind`` is ``"prefill"``, ``"decode"`` or
    ``"idle"``; ``tokens`` the query tokens run; ``batch_size`` the
    sequences; ``blocked`` why the head of the queue waited (a
    :class:`~ferrox.scheduler.admission.NotAdmitted` value, or ``None``);
    ``admitted`` the prompts whose first chunk ran; ``start`` and
    ``seconds`` its place on the cost model's clock."""

    index: int
    kind: str
    tokens: int
    batch_size: int
    blocked: str | None
    admitted: int
    start: float
    seconds: float


@dataclass
class SimulationResult:
    """Per-request results (by uid, in arrival order), per-step records, the
    order prompts were admitted in, and -- when asked for -- ``repr`` of
    every :class:`ScheduledStep`."""

    requests: dict[int, RequestResult]
    steps: list[StepRecord]
    admission_order: list[int]
    plans: list[str] | None = None

    @property
    def total_time(self) -> float:
        return self.steps[-1].start + self.steps[-1].seconds if self.steps else 0.0

    def summary(self) -> dict[str, float | int]:
        """Counts and percentiles a capacity plan reads (times in seconds)."""
        done = [r for r in self.requests.values() if r.finish_reason in ("stop", "length")]
        ttfts = sorted(r.ttft for r in done if r.ttft is not None)
        e2e = sorted(r.finish_time - r.arrival_time for r in done if r.finish_time is not None)
        kinds = [s.kind for s in self.steps]
        prompt = sum(r.prompt_len for r in done)
        cached = sum(r.cached_tokens or 0 for r in done)
        out = sum(r.output_tokens for r in done)
        total = self.total_time
        return {
            "requests": len(self.requests),
            "finished": len(done),
            "refused": sum(1 for r in self.requests.values() if r.finish_reason == "refused"),
            "aborted": sum(1 for r in self.requests.values() if r.finish_reason == "abort"),
            "steps": len(self.steps),
            "prefill_steps": kinds.count("prefill"),
            "decode_steps": kinds.count("decode"),
            "idle_steps": kinds.count("idle"),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "output_tokens": out,
            "sim_seconds": total,
            "output_tokens_per_s": out / total if total else 0.0,
            "ttft_p50_s": _percentile(ttfts, 0.5),
            "ttft_p99_s": _percentile(ttfts, 0.99),
            "e2e_p50_s": _percentile(e2e, 0.5),
            "e2e_p99_s": _percentile(e2e, 0.99),
            "mean_decode_batch": statistics.fmean(
                [s.batch_size for s in self.steps if s.kind == "decode"] or [0]
            ),
        }


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..1) of an ascending list; 0.0 for an empty one."""
    if not sorted_values:
        return 0.0
    rank = max(1, -(-int(q * 1_000_000) * len(sorted_values) // 1_000_000))
    return sorted_values[min(rank, len(sorted_values)) - 1]


class SimulationStalled(RuntimeError):
    """Live requests, nothing runnable, and nothing in the trace that could
    change that: a liveness bug in the scheduler (or a replica with no slots)."""


Check = Callable[[Scheduler, "ScheduledStep | None"], None]


class Simulator:
    """Replays traces against a fresh :class:`Scheduler` built from ``config``.

    ``check_plan(scheduler, step)`` runs after each ``schedule()`` (pages
    allocated, forward pass not yet "run"); ``check_commit(scheduler, step)``
    after each ``commit()`` (``step`` is ``None`` for an idle step). Both are
    for tests; the simulator's own checks always run.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cost: CostModel | None = None,
        *,
        check_plan: Check | None = None,
        check_commit: Check | None = None,
        record_plans: bool = False,
        max_steps: int = 1_000_000,
    ) -> None:
        self.config = config
        self.cost = cost or CostModel()
        self.check_plan = check_plan
        self.check_commit = check_commit
        self.record_plans = record_plans
        self.max_steps = max_steps
        self.scheduler: Scheduler | None = None

    def run(self, arrivals: Iterable[Arrival]) -> SimulationResult:
        """Run the trace to the end: every request finished, aborted or refused.

        Raises ``AssertionError`` when an integrity or contract check fails,
        :class:`SimulationStalled` when requests can never run, and whatever
        the scheduler raises (``OutOfPages`` is a scheduler bug).
        """
        trace = sorted(arrivals, key=lambda a: a.step)  # stable: ties keep trace order
        if len({a.uid for a in trace}) != len(trace):
            raise ValueError("arrival uids must be unique")
        sched = self.scheduler = Scheduler(self.config)
        page = self.config.page_size
        window = sched.kv.sliding_window
        by_uid = {a.uid: a for a in trace}
        results: dict[int, RequestResult] = {}
        steps: list[StepRecord] = []
        plans: list[str] | None = [] if self.record_plans else None
        order: list[int] = []
        computed: dict[int, int] = {}  # uid -> prompt positions done, while prefilling
        aborts: dict[int, list[int]] = {}
        for a in trace:
            if a.abort_step is not None:
                # A client cannot go away before it came.
                aborts.setdefault(max(a.abort_step, a.step), []).append(a.uid)
        live: set[int] = set()
        next_arrival = 0
        now = 0.0
        index = 0

        def end(uid: int, reason: str, step: int, time: float) -> None:
            r = results[uid]
            r.finish_step, r.finish_time, r.finish_reason = step, time, reason
            live.discard(uid)
            computed.pop(uid, None)

        while True:
            # Arrivals and aborts come in between steps, as the engine's lock allows.
            while next_arrival < len(trace) and trace[next_arrival].step <= index:
                a = trace[next_arrival]
                next_arrival += 1
                results[a.uid] = RequestResult(a.uid, a.prompt_len, a.output_len, index, now)
                try:
                    sched.add_request(a.uid, a.prompt, a.output_len)  # type: ignore[arg-type]
                except RequestRefused as refused:
                    results[a.uid].refused = refused.reason
                    end(a.uid, "refused", index, now)
                    continue
                live.add(a.uid)
            for step_at in [s for s in aborts if s <= index]:
                for uid in aborts.pop(step_at):
                    if uid in live:
                        sched.abort(uid)
                        end(uid, "abort", index, now)
            if not live and next_arrival >= len(trace):
                break
            if index >= self.max_steps:
                raise SimulationStalled(f"{len(live)} requests still live after {index} steps")
            step = sched.schedule()
            if step is None:
                # Nothing to run now: jump to whatever can change that.
                upcoming = [s for s in aborts if any(u in live for u in aborts[s])]
                if live and not upcoming:
                    raise SimulationStalled(
                        f"step {index}: {len(live)} live requests, nothing runnable "
                        f"(blocked: {sched.last_blocked}), no abort pending"
                    )
                candidates = upcoming + ([trace[next_arrival].step] if next_arrival < len(trace) else [])
                target = max(index + 1, min(candidates))
                if live:
                    steps.append(StepRecord(index, "idle", 0, 0, _blocked(sched.last_blocked), 0, now, 0.0))
                    if plans is not None:
                        plans.append("None")
                if self.check_commit is not None:
                    self.check_commit(sched, None)
                index = target
                continue
            if plans is not None:
                plans.append(repr(step))
            self._check_step(sched, step, by_uid, computed, page, window)
            if self.check_plan is not None:
                self.check_plan(sched, step)
            admitted = 0
            for seq in step.seqs:
                if seq.admission is not None:
                    admitted += 1
                    r = results[seq.uid]
                    r.admission_step = index
                    r.cached_tokens = seq.admission[1]
                    order.append(seq.uid)
            seconds = self.cost.step_seconds(step.kind, step.num_tokens, len(step.seqs))
            done_at = now + seconds
            sampled: dict[int, int] = {}
            stopped: list[int] = []
            for seq in step.seqs:
                if not seq.samples:
                    continue
                r = results[seq.uid]
                sampled[seq.uid] = fake_token(seq.uid, r.output_tokens)
                r.output_tokens += 1
                if r.first_token_step is None:
                    r.first_token_step, r.first_token_time = index, done_at
                stop_after = by_uid[seq.uid].stop_after
                if stop_after is not None and r.output_tokens == stop_after and stop_after < r.output_len:
                    stopped.append(seq.uid)
            released = sched.commit(step, sampled, stopped)
            for uid in released:
                end(uid, "stop" if uid in stopped else "length", index, done_at)
            for uid in stopped:
                if uid not in released:
                    raise AssertionError(f"step {index}: request {uid} stopped but was not released")
            for seq in step.seqs:
                r = results[seq.uid]
                if seq.uid in live and r.output_tokens >= r.output_len:
                    raise AssertionError(f"step {index}: request {seq.uid} spent its budget but is still live")
            sched.check_integrity()
            if self.check_commit is not None:
                self.check_commit(sched, step)
            steps.append(
                StepRecord(index, step.kind, step.num_tokens, len(step.seqs), _blocked(step.blocked), admitted, now, seconds)
            )
            now = done_at
            index += 1
        return SimulationResult(results, steps, order, plans)

    def _check_step(self, sched: Scheduler, step: ScheduledStep, by_uid, computed, page: int, window) -> None:
        """The contracts the runner relies on, for every sequence of ``step``."""
        seen: set[int] = set()
        for seq in step.seqs:
            if seq.uid in seen:
                raise AssertionError(f"request {seq.uid} appears twice in one step")
            seen.add(seq.uid)
            tokens = sched.tokens(seq.uid)
            if step.kind == "prefill":
                prompt_len = by_uid[seq.uid].prompt_len
                if seq.admission is not None:
                    if seq.uid in computed:
                        raise AssertionError(f"request {seq.uid}'s prompt was reported twice")
                    if seq.admission != (prompt_len, seq.computed_len):
                        raise AssertionError(f"request {seq.uid}: admission {seq.admission} for a chunk at {seq.computed_len}")
                    if seq.computed_len % page or seq.computed_len >= prompt_len:
                        raise AssertionError(f"request {seq.uid}: cached prefix of {seq.computed_len} tokens")
                elif computed.get(seq.uid) != seq.computed_len:
                    raise AssertionError(
                        f"request {seq.uid}: chunk starts at {seq.computed_len}, "
                        f"but {computed.get(seq.uid)} prompt tokens were done"
                    )
                if seq.seq_len > prompt_len or not seq.query_tokens:
                    raise AssertionError(f"request {seq.uid}: chunk {seq.computed_len}..{seq.seq_len} of {prompt_len}")
                if seq.samples != (seq.seq_len == prompt_len):
                    raise AssertionError(f"request {seq.uid}: samples={seq.samples} at {seq.seq_len}/{prompt_len}")
                computed[seq.uid] = seq.seq_len
            else:
                if seq.uid in computed and computed[seq.uid] < by_uid[seq.uid].prompt_len:
                    raise AssertionError(f"request {seq.uid} decodes before its prompt is done")
                if len(seq.query_tokens) != 1 or seq.computed_len != len(tokens) - 1 or not seq.samples:
                    raise AssertionError(f"request {seq.uid}: bad decode sequence {seq}")
            if seq.query_tokens != tuple(tokens[seq.computed_len : seq.seq_len]):
                raise AssertionError(f"request {seq.uid}: query tokens are not the request's tokens")
            if len(seq.pages) != -(-seq.seq_len // page):
                raise AssertionError(
                    f"request {seq.uid}: {len(seq.pages)} pages for {seq.seq_len} positions of {page}"
                )
            if window is not None:
                # The first query sees keys > computed_len - window; those
                # pages must still be held while this step runs.
                first_key = max(seq.computed_len - window + 1, 0)
                if seq.swa_start > first_key or seq.swa_start % page:
                    raise AssertionError(
                        f"request {seq.uid}: window pages start at {seq.swa_start}, "
                        f"but a query at {seq.computed_len} attends from {first_key}"
                    )
                if seq.swa_start + len(seq.swa_pages) * page != align_ceil(seq.seq_len, page):
                    raise AssertionError(
                        f"request {seq.uid}: window pages cover {seq.swa_start}.."
                        f"{seq.swa_start + len(seq.swa_pages) * page}, the step reaches {seq.seq_len}"
                    )


def _blocked(reason) -> str | None:
    return None if reason is None else reason.value


def synthetic_trace(
    requests: int,
    prompt_len: int,
    output_len: int,
    *,
    seed: int = 0,
    arrivals_per_step: float = 1.0,
    shared_prefix_len: int = 0,
    prefix_groups: int = 4,
    stop_fraction: float = 0.2,
    abort_fraction: float = 0.02,
) -> list[Arrival]:
    """A reproducible random trace.

    Prompt and output lengths are uniform in ``[len/2, 3*len/2]``; arrivals
    are a Poisson process of ``arrivals_per_step`` per scheduler step; a
    request shares a ``shared_prefix_len``-token prefix with the others of its
    group (one of ``prefix_groups``) when ``shared_prefix_len`` > 0; a
    ``stop_fraction`` stop early (at a uniform output token) and an
    ``abort_fraction`` are aborted a few steps after arriving.
    """
    rng = random.Random(seed)
    prefixes = [prompt_tokens(10_000_000 + g, shared_prefix_len) for g in range(prefix_groups)]
    out: list[Arrival] = []
    t = 0.0
    for uid in range(requests):
        t += rng.expovariate(arrivals_per_step) if arrivals_per_step > 0 else 0.0
        plen = rng.randint(max(1, prompt_len // 2), max(1, prompt_len * 3 // 2))
        olen = rng.randint(max(1, output_len // 2), max(1, output_len * 3 // 2))
        prefix = prefixes[rng.randrange(prefix_groups)] if shared_prefix_len else ()
        stop = rng.randint(1, olen) if rng.random() < stop_fraction else None
        step = int(t)
        abort = step + rng.randint(0, 50) if rng.random() < abort_fraction else None
        out.append(Arrival(uid, step, prompt_tokens(uid, plen, prefix), olen, stop, abort))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ferrox.scheduler.simulator",
        description="Replay a synthetic trace through the scheduler and print a summary.",
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=512, help="mean prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="mean max_tokens")
    parser.add_argument("--pages", type=int, default=4096, help="full-attention KV pages")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--slots", type=int, default=64, help="request slots")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill tokens per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=1.0, help="arrivals per step")
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens of a shared prompt prefix")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--window", type=int, default=None, help="sliding window (a window model)")
    parser.add_argument("--window-pages", type=int, default=0, help="window-pool pages")
    parser.add_argument("--recurrent-slots", type=int, default=0, help="recurrent-state slots (a recurrent model)")
    args = parser.parse_args(argv)
    config = SchedulerConfig(
        page_size=args.page_size,
        num_pages=args.pages,
        max_slots=args.slots,
        max_prefill_tokens=args.chunk,
        max_model_len=args.max_model_len,
        sliding_window=args.window,
        num_swa_pages=args.window_pages if args.window else 0,
        recurrent=args.recurrent_slots > 0,
        num_recurrent_slots=args.recurrent_slots,
    )
    trace = synthetic_trace(
        args.requests,
        args.prompt_len,
        args.output_len,
        seed=args.seed,
        arrivals_per_step=args.rate,
        shared_prefix_len=args.shared_prefix,
    )
    result = Simulator(config).run(trace)
    print(f"config: {config}")
    for key, value in result.summary().items():
        print(f"{key:>22}: {value:.4f}" if isinstance(value, float) else f"{key:>22}: {value}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
