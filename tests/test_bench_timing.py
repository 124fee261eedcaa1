"""--timing osu of the bench and the tuner: the flag, OSU's latency columns under torchrun (every
result checked, times only sane: positive and ordered), the tuning file recording the timing, and
the aggregation of per-call times (the median of per-call maxima, avg/min/max over ranks) on
made-up numbers in one process."""

from __future__ import annotations

import json

import pytest
import torch

from test_cli import one_rank_group, run_torchrun  # noqa: F401 (one_rank_group: a fixture)
from torch_torus import tuning
from torch_torus.bench import timing


def test_timing_is_loop_unless_osu_is_asked_for():
    from torch_torus import tune
    from torch_torus.bench.cli import parse_args

    assert parse_args([]).timing == "loop"
    assert parse_args(["--timing", "osu"]).timing == "osu"
    assert tune.build_parser().parse_args(["--timing", "osu"]).timing == "osu"


@pytest.mark.parametrize("program", ["bench", "tune"])
def test_timing_refuses_other_values_naming_the_flag(program, capsys):
    from torch_torus import tune
    from torch_torus.bench.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--timing", "mean"]) if program == "bench" else tune.main(["--timing", "mean"])
    error = capsys.readouterr().err
    assert "argument --timing: invalid choice: 'mean'" in error and "'loop', 'osu'" in error, error


def test_osu_bench_reports_latency_over_ranks_and_checks_every_result(tmp_path):
    json_path = tmp_path / "bench.json"
    output = run_torchrun(["-m", "torch_torus.bench", "--timing", "osu", "--backends", "torus;gloo",
                           "-b", "4K", "-e", "64K", "-f", "16", "-n", "5", "-w", "2", "-R", "2", "--check",
                           "--json", str(json_path)])
    assert "# timing osu: 5 timed calls after 2 warmup calls" in output, output
    assert "2 rounds of every contender in turn, the median over all rounds' calls counts" in output, output
    assert "# time = median over calls of the slowest rank's time of the call" in output, output
    assert output.count("avg lat") == 2, output  # one group of columns per contender
    assert "# Out of bounds values : 0 OK" in output, output
    document = json.loads(json_path.read_text())
    assert document["timing"] == "osu"
    rows = document["rows"]
    assert sorted((row["contender"], row["size_bytes"]) for row in rows) == [
        ("gloo", 4096), ("gloo", 65536), ("torus", 4096), ("torus", 65536)]
    for row in rows:
        assert row["wrong"] == 0 and row["time_us"] > 0, row
        assert 0 < row["latency_min_us"] <= row["latency_avg_us"] <= row["latency_max_us"], row
        assert row["exit_skew_us"] >= 0 and row["after_last_us"] > 0, row  # one host: one clock


def test_osu_tuning_entry_records_its_timing(tmp_path):
    path = tmp_path / "tuning.json"
    output = run_torchrun(["-m", "torch_torus.tune", "--timing", "osu", "-b", "4K", "-e", "4K", "-n", "3",
                           "-w", "1", "-r", "1", "-o", str(path)])
    assert "timing osu: a barrier of the contender's own before each call" in output, output
    assert "(us, median call of the slowest rank;" in output, output
    [entry] = tuning.read(str(path))
    assert entry.timing == "osu" and entry.record["timing"] == "osu"
    assert all(times[0] is None or times[0] > 0 for times in entry.record["measured"]["time_us"].values())


def test_an_entry_without_a_timing_was_timed_with_loop():
    layout = tuning.Layout(2, None, (2,), "shm")
    entry = tuning.make_entry(layout, [4096], {"ring": [10.0]}, {})
    assert tuning.Entry(layout, (), entry).timing == "loop"


def test_a_call_counts_at_its_slowest_rank_and_latency_at_each_rank_mean():
    # Two ranks, four calls: the slowest rank's of each call are 3, 5, 2 and 8 us, whose median is
    # 4 us; rank 0's mean is 3 us, rank 1's 3.5 us.
    seconds = torch.tensor([[1.0, 5.0, 2.0, 4.0], [3.0, 1.0, 2.0, 8.0]], dtype=torch.float64) * 1e-6
    starts = torch.tensor([[0.0, 10.0, 20.0, 30.0]] * 2, dtype=torch.float64)
    measured = timing.measured_from_calls(starts, starts + seconds)
    assert measured.seconds == pytest.approx(4e-6)
    assert vars(measured.latency) == pytest.approx({"avg": 3.25e-6, "min": 3e-6, "max": 3.5e-6})
    assert measured.breakdown is None  # several clocks: no breakdown


def test_breakdown_splits_a_call_into_exit_skew_and_the_call_after_the_last_start():
    # Three ranks, three calls, on one clock. Call 0: starts 0, 2, 5, ends 9, 9, 9: skew 5, 4 after
    # the last start. Call 1: starts 0, 0, 1, ends 3, 4, 2: skew 1, 3 after. Call 2: starts 3, 0,
    # 0, ends 10, 10, 10: skew 3, 7 after. Medians: skew 3, after 4.
    starts = torch.tensor([[0.0, 100.0, 203.0], [2.0, 100.0, 200.0], [5.0, 101.0, 200.0]], dtype=torch.float64)
    ends = torch.tensor([[9.0, 103.0, 210.0], [9.0, 104.0, 210.0], [9.0, 102.0, 210.0]], dtype=torch.float64)
    measured = timing.measured_from_calls(starts, ends, one_clock=True)
    assert vars(measured.breakdown) == pytest.approx({"exit_skew": 3.0, "after_last": 4.0})
    # The slowest rank's of each call: 9, 4, 10.
    assert measured.seconds == pytest.approx(9.0)


def test_osu_rounds_count_every_call_of_every_round(one_rank_group, monkeypatch):  # noqa: F811
    # Each contender's seconds of each call in rounds 0 and 1, as time_each_call would measure them.
    script = [[[4.0, 1.0, 9.0], [2.0, 3.0, 8.0]], [[5.0, 5.0, 5.0], [1.0, 1.0, 1.0]]]
    rounds_done = [0, 0]
    barriers = []

    def scripted_time_each_call(call, calls, warmup, barrier, synchronize):
        index = call()
        barrier()
        assert calls == 3 and warmup == 1
        rounds_done[index] += 1
        return [(10.0 * i, 10.0 * i + seconds) for i, seconds in enumerate(script[index][rounds_done[index] - 1])]

    monkeypatch.setattr(timing, "time_each_call", scripted_time_each_call)
    plan = timing.RoundPlan(iters=3, warmup=1, rounds=2, min_round_ms=0.0, timing="osu")
    first, second = timing.time_contenders([lambda: 0, lambda: 1], plan, one_rank_group,
                                           barriers=[lambda: barriers.append(0), lambda: barriers.append(1)],
                                           one_clock=True)

    # The median of all six calls, not the best round's: 3.5 s (rounds of 4.67 and 4.33 s on average).
    assert first.seconds == pytest.approx(3.5) and second.seconds == pytest.approx(3.0)
    assert vars(first.latency) == pytest.approx({"avg": 4.5, "min": 4.5, "max": 4.5})
    assert rounds_done == [2, 2]
    assert sorted(barriers) == [0, 0, 1, 1]  # each contender's calls after its own barrier
    # One rank: nothing to wait for at the barrier, the call all after the last start.
    assert first.breakdown.exit_skew == 0 and first.breakdown.after_last == pytest.approx(3.5)


def test_header_says_which_timing_and_what_time_is():
    from torch_torus.bench.cli import parse_args
    from torch_torus.bench.collectives import COLLECTIVES
    from torch_torus.bench.report import Table, header

    collective = COLLECTIVES["allreduce"](2, 0, 0)
    for timing_name, time_is in (("loop", "# time = mean per call, slowest rank;"),
                                 ("osu", "# time = median over calls of the slowest rank's time of the call;")):
        args = parse_args(["--backends", "gloo", "--timing", timing_name])
        lines = header(collective, args, ["host"] * 2) + Table(collective, args).header_lines()
        text = "\n".join(lines)
        assert f"# timing {timing_name}: {args.iters} timed calls" in text, text
        assert time_is in text, text
        assert ("avg lat" in text) == (timing_name == "osu"), text
