"""Benchmark: how long the scheduler takes to plan one step under load.

Decided here: the load and the figures. A replica with ``--running``
requests holding every request slot and ``--waiting`` more queued behind
them (512 and 256 by default), for each geometry (full attention, a sliding
window, a recurrent model), kept in that state by replacing each request
that finishes with a new arrival. Every step is timed twice from the same
run: :meth:`StepPlanner.plan` alone (the admission and decode decision) and
:meth:`Scheduler.schedule` whole (the plan, then page allocation, prefix
locking and the :class:`ScheduledStep` the runner reads); ``commit`` is
timed too, since the engine pays for it under the same lock. Steps are a
mix: decode steps of every running request, and a prefill step whenever a
finished request freed a slot.

Why: the engine plans under a lock the forward pass waits on, so planning
time is added to every step's latency; the target is a median under 0.5 ms
for ``plan`` with 256 running and 512 waiting on one core.

Deliberately not a test: timings depend on the machine and its load, so
this prints figures and asserts nothing. Run
``python -m ferrox.scheduler.bench``.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from dataclasses import dataclass

from .core import Scheduler, SchedulerConfig
from .simulator import fake_token, prompt_tokens

GEOMETRIES = ("full", "window", "recurrent")


def config_for(geometry: str, running: int, page_size: int = 16, chunk: int = 2048) -> SchedulerConfig:
    """A replica whose request slots, not its memory, bound the running set."""
    pages = running * (768 + 512) // page_size * 5 // 4
    extra: dict = {}
    if geometry == "window":
        extra = dict(sliding_window=256, num_swa_pages=pages)
    elif geometry == "recurrent":
        extra = dict(recurrent=True, num_recurrent_slots=3 * running)
    return SchedulerConfig(
        page_size=page_size,
        num_pages=pages,
        max_slots=running,
        max_prefill_tokens=chunk,
        max_model_len=4096,
        **extra,
    )


@dataclass
class Timings:
    geometry: str
    plan: list[float]
    schedule: list[float]
    commit: list[float]
    kinds: list[str]
    running: int
    waiting: int

    def row(self, which: str, kind: str | None = None) -> tuple[float, float, int]:
        values = getattr(self, which)
        if kind is not None:
            values = [v for v, k in zip(values, self.kinds) if k == kind]
        if not values:
            return 0.0, 0.0, 0
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return statistics.median(ordered) * 1e3, p99 * 1e3, len(ordered)


def run(geometry: str, running: int = 256, waiting: int = 512, steps: int = 1000, seed: int = 0) -> Timings:
    """Bring a replica to ``running`` + ``waiting`` requests, then time ``steps`` steps."""
    rng = random.Random(seed)
    sched = Scheduler(config_for(geometry, running))
    planner = sched.planner
    plan_times: list[float] = []
    inner = planner.plan

    def timed_plan(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            plan_times.append(time.perf_counter() - t0)

    planner.plan = timed_plan  # type: ignore[method-assign]
    next_uid = 0
    outputs: dict[int, int] = {}

    def arrive() -> None:
        nonlocal next_uid
        sched.add_request(next_uid, prompt_tokens(next_uid, rng.randint(256, 768)), rng.randint(64, 512))
        outputs[next_uid] = 0
        next_uid += 1

    def step(record: Timings | None) -> None:
        t0 = time.perf_counter()
        scheduled = sched.schedule()
        t1 = time.perf_counter()
        assert scheduled is not None, "the benchmark's replica went idle"
        sampled = {}
        for seq in scheduled.seqs:
            if seq.samples:
                sampled[seq.uid] = fake_token(seq.uid, outputs[seq.uid])
                outputs[seq.uid] += 1
        released = sched.commit(scheduled, sampled)
        t2 = time.perf_counter()
        for uid in released:
            del outputs[uid]
            arrive()
        if record is not None:
            record.schedule.append(t1 - t0)
            record.commit.append(t2 - t1)
            record.kinds.append(scheduled.kind)
            record.plan.append(plan_times[-1])

    for _ in range(running + waiting):
        arrive()
    while planner.num_running < running or planner.num_waiting != planner.num_waiting_new:
        step(None)
    timings = Timings(geometry, [], [], [], [], planner.num_running, planner.num_waiting)
    gc.collect()
    for _ in range(steps):
        step(timings)
    sched.check_integrity()
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ferrox.scheduler.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--waiting", type=int, default=512)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--geometry", choices=GEOMETRIES, action="append")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"{args.running} running, {args.waiting} waiting, {args.steps} timed steps per geometry; ms")
    print(f"{'geometry':<10} {'timed':<9} {'steps':<8} {'n':>5} {'median':>8} {'p99':>8}")
    for geometry in args.geometry or GEOMETRIES:
        t = run(geometry, args.running, args.waiting, args.steps, args.seed)
        for which in ("plan", "schedule", "commit"):
            for kind in (None, "decode", "prefill"):
                median, p99, n = t.row(which, kind)
                print(f"{geometry:<10} {which:<9} {kind or 'all':<8} {n:>5} {median:>8.3f} {p99:>8.3f}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
