"""The benchmark runs and reports what it says it measures (its figures are printed, never asserted)."""

from __future__ import annotations

from ferrox.scheduler.bench import GEOMETRIES, config_for, main, run


def test_the_benchmark_holds_its_replica_at_the_requested_load():
    for geometry in GEOMETRIES:
        t = run(geometry, running=8, waiting=16, steps=30)
        assert (t.running, t.waiting) == (8, 16)
        assert len(t.plan) == len(t.schedule) == len(t.commit) == len(t.kinds) == 30
        assert set(t.kinds) <= {"prefill", "decode"} and "decode" in t.kinds
        assert all(p <= s for p, s in zip(t.plan, t.schedule)), "plan is timed inside schedule"


def test_the_replica_is_bounded_by_slots_not_memory():
    config = config_for("window", running=256)
    assert (config.max_slots, config.sliding_window, config.num_swa_pages) == (256, 256, config.num_pages)
    assert config_for("recurrent", running=256).num_recurrent_slots == 768


def test_the_command_line_prints_medians_and_p99s(capsys):
    assert main(["--running", "4", "--waiting", "8", "--steps", "10", "--geometry", "full"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "4 running, 8 waiting, 10 timed steps per geometry; ms"
    assert lines[1].split() == ["geometry", "timed", "steps", "n", "median", "p99"]
    assert [line.split()[:3] for line in lines[2:5]] == [["full", "plan", "all"], ["full", "plan", "decode"], ["full", "plan", "prefill"]]
    assert len(lines) == 2 + 9
