"""Scenarios from real bug reports, replayed exactly, and the determinism of a replayed trace."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ferrox.scheduler.admission import Capacity, Geometry, NotAdmitted, PendingRequest, PrefillPass
from ferrox.scheduler.core import Scheduler, SchedulerConfig
from ferrox.scheduler.planner import RequestRefused
from ferrox.scheduler.simulator import Arrival, Simulator, prompt_tokens, synthetic_trace

REPO = Path(__file__).resolve().parents[2]


def test_a_prompt_larger_than_the_whole_kv_pool_is_refused_at_arrival_and_the_queue_moves_on():
    """A 100,000-token prompt on a replica whose KV pool holds 76,640 tokens
    (context 262,144) used to wait at the head of the queue forever."""
    config = SchedulerConfig(
        page_size=16, num_pages=76_640 // 16, max_slots=8, max_prefill_tokens=8192, max_model_len=262_144
    )
    sched = Scheduler(config)
    with pytest.raises(RequestRefused) as info:
        sched.add_request(0, prompt_tokens(0, 100_000), 1024)
    err = info.value
    assert (err.reason, err.requested, err.limit) == ("kv_pool", 101_024, 76_640)
    assert str(err) == (
        "prompt (100000 tokens) + max_tokens (1024) = 101024 tokens "
        "can never fit this replica's KV pool of 76640 tokens"
    )

    trace = [Arrival(0, 0, 100_000, 1024)] + [Arrival(uid, 0, 2000, 50) for uid in range(1, 5)]
    result = Simulator(config).run(trace)
    assert (result.requests[0].finish_reason, result.requests[0].refused) == ("refused", "kv_pool")
    assert result.admission_order == [1, 2, 3, 4]
    assert [result.requests[uid].admission_step for uid in range(1, 5)] == [0, 0, 0, 0]
    assert all(result.requests[uid].finish_reason == "length" for uid in range(1, 5))


def test_a_large_request_at_the_head_is_not_overtaken_and_runs_the_step_after_pages_free():
    """Waiting [needs 1,000 pages, needs 10, needs 10] with 50 pages free: the
    small ones must not be admitted ahead of the large one, which must be
    admitted on the step after enough pages come free."""
    config = SchedulerConfig(page_size=16, num_pages=1050, max_slots=8, max_prefill_tokens=16_384, max_model_len=32_768)
    trace = [
        Arrival(0, 0, 15_984, 2),  # runs first; holds 999 pages after its prefill
        Arrival(1, 0, 15_000, 1000),  # 16,000 tokens: 1,000 pages
        Arrival(2, 0, 100, 60),  # 160 tokens: 10 pages
        Arrival(3, 0, 100, 60),
    ]
    free_pages_at: dict[int, int] = {}

    def measure(sched: Scheduler, step) -> None:
        # What admission can use at the next step: free + evictable - reserved, in pages.
        cap = sched.kv.capacity(sched.planner.slots.available)
        free_pages_at[len(free_pages_at)] = (cap.kv_tokens - sched.planner.inflight_tokens()) // 16

    result = Simulator(config, check_commit=measure).run(trace)
    steps = [(s.kind, s.batch_size, s.blocked) for s in result.steps[:3]]
    assert steps == [
        ("prefill", 1, "kv_budget"),  # request 0 admitted; the 1,000-page request does not fit
        ("decode", 1, "kv_budget"),  # 50 pages free: the 10-page requests wait behind it
        ("prefill", 3, None),  # request 0 ended at step 1: all three, in order
    ]
    assert free_pages_at[0] == 50
    assert [result.requests[uid].admission_step for uid in range(4)] == [0, 2, 2, 2]
    assert result.requests[0].finish_step == 1
    assert result.admission_order == [0, 1, 2, 3]


def test_a_recurrent_model_is_bounded_by_its_recurrent_slots_not_its_kv():
    """8,070,656 free KV tokens but 2 free recurrent slots: the next request
    waits on the recurrent pool."""
    direct = PrefillPass(8192, 0, Geometry(page_size=16, recurrent=True))
    capacity = Capacity(request_slots=64, kv_tokens=8_070_656, swa_tokens=0, recurrent_slots=2)
    assert direct.check_admission(PendingRequest(1, 1000, 100), 0, capacity) is NotAdmitted.RECURRENT_BUDGET

    config = SchedulerConfig(
        page_size=16,
        num_pages=8_070_656 // 16 + 1,
        max_slots=64,
        max_prefill_tokens=8192,
        max_model_len=32_768,
        recurrent=True,
        num_recurrent_slots=5,
    )
    sched = Scheduler(config)
    sched.add_request(1, prompt_tokens(1, 16), 4)
    sched.add_request(2, prompt_tokens(2, 16), 4)
    step = sched.schedule()
    assert ([s.uid for s in step.seqs], step.blocked) == ([1], NotAdmitted.RECURRENT_BUDGET)
    sched.commit(step, {1: 0})
    assert sched.kv.capacity(sched.planner.slots.available) == Capacity(
        request_slots=63, kv_tokens=8_070_656, swa_tokens=0, recurrent_slots=2
    )
    step = sched.schedule()
    assert (step.kind, step.blocked) == ("decode", NotAdmitted.RECURRENT_BUDGET)


def test_a_recurrent_pool_of_760_slots_runs_at_most_253_requests_at_once():
    config = SchedulerConfig(
        page_size=16,
        num_pages=4096,
        max_slots=512,
        max_prefill_tokens=8192,
        max_model_len=4096,
        recurrent=True,
        num_recurrent_slots=760,
    )
    running: list[int] = []
    result = Simulator(
        config, check_plan=lambda sched, step: running.append(sched.planner.num_running)
    ).run([Arrival(uid, 0, 8, 4) for uid in range(300)])
    assert max(running) == 253 == 760 // 3
    assert result.steps[0].admitted == 253 and result.steps[0].blocked == "recurrent_budget"
    assert result.summary()["finished"] == 300


# -------------------------------------------------------------- determinism
CONFIGS = {
    "full": SchedulerConfig(page_size=16, num_pages=300, max_slots=12, max_prefill_tokens=256, max_model_len=8192),
    "window": SchedulerConfig(
        page_size=16,
        num_pages=300,
        max_slots=12,
        max_prefill_tokens=256,
        max_model_len=8192,
        sliding_window=64,
        num_swa_pages=80,
    ),
    "recurrent": SchedulerConfig(
        page_size=16,
        num_pages=300,
        max_slots=12,
        max_prefill_tokens=256,
        max_model_len=8192,
        recurrent=True,
        num_recurrent_slots=20,
    ),
}


def trace():
    return synthetic_trace(60, 200, 24, seed=3, arrivals_per_step=0.5, shared_prefix_len=48, abort_fraction=0.1)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_the_same_trace_gives_byte_identical_plans(kind):
    first = Simulator(CONFIGS[kind], record_plans=True).run(trace())
    second = Simulator(CONFIGS[kind], record_plans=True).run(trace())
    assert len(first.plans) == len(first.steps) > 100
    assert first.plans == second.plans
    assert first.steps == second.steps
    assert first.requests == second.requests


PLAN_DIGEST = """
import hashlib, sys
sys.path.insert(0, sys.argv[1])
from tests.scheduler.test_scenarios import CONFIGS, trace
from ferrox.scheduler.simulator import Simulator
h = hashlib.sha256()
for kind in sorted(CONFIGS):
    for plan in Simulator(CONFIGS[kind], record_plans=True).run(trace()).plans:
        h.update(plan.encode())
print(h.hexdigest())
"""


def test_plans_do_not_depend_on_the_processes_hash_seed():
    digests = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", PLAN_DIGEST, str(REPO)], env=env, cwd=REPO, capture_output=True, text=True, check=True
        )
        digests.add(out.stdout.strip())
    here = hashlib.sha256()
    for kind in sorted(CONFIGS):
        for plan in Simulator(CONFIGS[kind], record_plans=True).run(trace()).plans:
            here.update(plan.encode())
    digests.add(here.hexdigest())
    assert len(digests) == 1
