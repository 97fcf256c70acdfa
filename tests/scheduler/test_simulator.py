"""The trace simulator: its clocks, per-request results, step records, stall detection and CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ferrox.scheduler.core import SchedulerConfig
from ferrox.scheduler.simulator import (
    Arrival,
    CostModel,
    RequestResult,
    SimulationStalled,
    Simulator,
    StepRecord,
    fake_token,
    main,
    prompt_tokens,
    synthetic_trace,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG = SchedulerConfig(page_size=4, num_pages=32, max_slots=4, max_prefill_tokens=8, max_model_len=256)
COST = CostModel(prefill_token_s=0.01, decode_seq_s=0.1, step_overhead_s=1.0)


def test_a_cost_model_charges_overhead_plus_tokens_or_sequences():
    assert COST.step_seconds("prefill", 5, 1) == pytest.approx(1.05)
    assert COST.step_seconds("decode", 3, 3) == pytest.approx(1.3)
    assert COST.step_seconds("idle", 0, 0) == 0.0


def test_one_request_is_timed_on_both_clocks():
    result = Simulator(CONFIG, COST).run([Arrival(7, 0, 5, 3)])
    assert result.steps == [
        StepRecord(0, "prefill", 5, 1, None, 1, 0.0, pytest.approx(1.05)),
        StepRecord(1, "decode", 1, 1, None, 0, pytest.approx(1.05), pytest.approx(1.1)),
        StepRecord(2, "decode", 1, 1, None, 0, pytest.approx(2.15), pytest.approx(1.1)),
    ]
    assert result.requests[7] == RequestResult(
        uid=7,
        prompt_len=5,
        output_len=3,
        arrival_step=0,
        arrival_time=0.0,
        admission_step=0,
        cached_tokens=0,
        first_token_step=0,
        first_token_time=pytest.approx(1.05),
        finish_step=2,
        finish_time=pytest.approx(3.25),
        finish_reason="length",
        output_tokens=3,
    )
    assert result.requests[7].ttft == pytest.approx(1.05)
    assert result.total_time == pytest.approx(3.25)
    assert result.admission_order == [7]


def test_the_clock_jumps_to_the_next_arrival_when_nothing_is_live():
    result = Simulator(CONFIG, COST).run([Arrival(1, 0, 3, 1), Arrival(2, 10, 3, 1)])
    assert [(s.index, s.kind) for s in result.steps] == [(0, "prefill"), (10, "prefill")]
    assert result.requests[2].arrival_time == pytest.approx(1.03), "an empty stretch costs no time"


def test_a_long_prompt_is_admitted_once_and_chunked_across_steps():
    result = Simulator(CONFIG, COST).run([Arrival(1, 0, 20, 2)])
    assert [(s.kind, s.tokens, s.admitted) for s in result.steps] == [
        ("prefill", 8, 1),
        ("prefill", 8, 0),
        ("prefill", 4, 0),
        ("decode", 1, 0),
    ]
    assert (result.requests[1].admission_step, result.requests[1].first_token_step) == (0, 2)


def test_early_stops_aborts_and_refusals_are_reported_as_such():
    trace = [
        Arrival(1, 0, 6, 10, stop_after=2),
        Arrival(2, 0, 6, 10, abort_step=3),
        Arrival(3, 0, 300, 10),  # beyond the 256-token context
        Arrival(4, 0, 6, 2, stop_after=2),  # the budget ends at the same token: "length"
    ]
    config = SchedulerConfig(page_size=4, num_pages=32, max_slots=4, max_prefill_tokens=64, max_model_len=256)
    result = Simulator(config, COST).run(trace)
    summary = {uid: (r.finish_reason, r.finish_step, r.output_tokens) for uid, r in result.requests.items()}
    assert summary == {1: ("stop", 1, 2), 2: ("abort", 3, 3), 3: ("refused", 0, 0), 4: ("length", 1, 2)}
    assert result.requests[3].refused == "context_length"
    assert result.admission_order == [1, 2, 4]


def test_an_abort_before_arrival_lands_on_arrival():
    result = Simulator(CONFIG, COST).run([Arrival(1, 5, 6, 10, abort_step=2)])
    r = result.requests[1]
    assert (r.finish_reason, r.finish_step, r.admission_step) == ("abort", 5, None)
    assert result.steps == []


def test_a_trace_that_can_never_run_is_reported_as_stalled():
    config = SchedulerConfig(page_size=4, num_pages=32, max_slots=0, max_prefill_tokens=8, max_model_len=256)
    with pytest.raises(SimulationStalled, match="1 live requests, nothing runnable"):
        Simulator(config).run([Arrival(1, 0, 6, 2)])


def test_arrival_uids_must_be_unique():
    with pytest.raises(ValueError, match="unique"):
        Simulator(CONFIG).run([Arrival(1, 0, 6, 2), Arrival(1, 1, 6, 2)])


def test_prompts_share_exactly_the_prefix_they_are_given():
    prefix = prompt_tokens(99, 6)
    a, b = prompt_tokens(1, 10, prefix), prompt_tokens(2, 10, prefix)
    assert a[:6] == b[:6] == prefix and a[6] != b[6]
    assert prompt_tokens(1, 4, prefix) == prefix[:4]
    assert Arrival(1, 0, 10, 1).prompt == prompt_tokens(1, 10)
    assert fake_token(3, 4) == fake_token(3, 4) != fake_token(3, 5)


def test_shared_prefixes_become_prefix_hits():
    prefix = prompt_tokens(99, 8)
    trace = [Arrival(1, 0, prompt_tokens(1, 12, prefix), 1), Arrival(2, 5, prompt_tokens(2, 12, prefix), 1)]
    result = Simulator(CONFIG, COST).run(trace)
    assert (result.requests[1].cached_tokens, result.requests[2].cached_tokens) == (0, 8)
    assert result.summary()["cached_tokens"] == 8


def test_a_synthetic_trace_is_reproducible_from_its_seed():
    a = synthetic_trace(50, 100, 20, seed=5, shared_prefix_len=16)
    assert a == synthetic_trace(50, 100, 20, seed=5, shared_prefix_len=16)
    assert a != synthetic_trace(50, 100, 20, seed=6, shared_prefix_len=16)
    assert all(50 <= x.prompt_len <= 150 and 10 <= x.output_len <= 30 for x in a)
    assert [x.step for x in a] == sorted(x.step for x in a)


def test_the_summary_counts_every_request_once():
    trace = synthetic_trace(40, 60, 12, seed=1, abort_fraction=0.2)
    summary = Simulator(CONFIG).run(trace).summary()
    assert summary["requests"] == 40
    assert summary["finished"] + summary["aborted"] + summary["refused"] == 40
    assert summary["steps"] == summary["prefill_steps"] + summary["decode_steps"] + summary["idle_steps"]
    assert 0 < summary["ttft_p50_s"] <= summary["ttft_p99_s"] <= summary["e2e_p99_s"]


def test_the_command_line_prints_a_summary(capsys):
    assert main(["--requests", "30", "--prompt-len", "64", "--output-len", "8", "--pages", "256", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    lines = dict(line.split(":", 1) for line in out.splitlines() if ":" in line and not line.startswith("config"))
    fields = {k.strip(): v.strip() for k, v in lines.items()}
    assert fields["requests"] == "30"
    assert int(fields["finished"]) + int(fields["aborted"]) + int(fields["refused"]) == 30


def test_the_module_runs_as_a_program():
    out = subprocess.run(
        [sys.executable, "-m", "ferrox.scheduler.simulator", "--requests", "20", "--slots", "4", "--chunk", "128",
         "--page-size", "8", "--pages", "512", "--prompt-len", "100", "--output-len", "10", "--seed", "0"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout
    assert "requests: 20" in out and "output_tokens_per_s" in out
