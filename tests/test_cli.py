"""The command-line tools under torchrun, as a user starts them: the bench (2 ranks, tiny sizes,
several rounds, every result checked) and the tuner (a tuning file a later group takes); and the
rounds both time with (torch_torus.bench.timing), in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from test_bench_mpi import REPOSITORY, run_bounded
from torch_torus import tuning
from torch_torus.bench import timing


def run_torchrun(arguments: list[str]) -> str:
    """torchrun --nproc-per-node 2 ARGUMENTS, bounded; its output, which must say it succeeded."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPOSITORY, os.environ.get("PYTHONPATH")]))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", tuning.VARIABLE):
        env.pop(name, None)
    result = run_bounded(command + arguments, env)
    assert result.returncode == 0, result.stdout
    return result.stdout


def test_bench_rounds_time_every_contender_and_report_the_best(tmp_path):
    json_path = tmp_path / "bench.json"
    output = run_torchrun(["-m", "torch_torus.bench", "--backends",
                           "torus:allreduce=ring;torus:allreduce=recursive_doubling;torus:api=op;gloo",
                           "-b", "1K", "-e", "16K",
                           "-f", "4", "-n", "2", "-w", "1", "-R", "3", "--min-round-ms", "2", "--check",
                           "--json", str(json_path)])
    assert "3 rounds of every contender in turn, the best round counts; after the first round, as many calls " \
           "as last 2 ms" in output, output
    assert "# Out of bounds values : 0 OK" in output, output
    assert "options: allreduce=ring, over shm" in output, output  # 2 ranks on one host: auto takes shm
    document = json.loads(json_path.read_text())
    assert document["rounds"] == 3 and document["min_round_ms"] == 2
    rows = document["rows"]
    assert sorted({row["size_bytes"] for row in rows}) == [1024, 4096, 16384]
    assert len(rows) == 12 and all(row["wrong"] == 0 and row["time_us"] > 0 for row in rows), rows
    assert sum(row["contender"] == "torus:api=op" for row in rows) == 3, rows
    # One host, CPU tensors: the memory's bound, measured by both ranks (2 cores here, or more).
    memory = document["host_memory_bandwidth"]
    assert memory["processes"] == min(2, len(os.sched_getaffinity(0))) and memory["gbps"] > 0, memory
    assert memory["gbps"] == max(memory["plain_gbps"], memory["streaming_gbps"]), memory
    assert "# host memory: " in output and "%mem" in output, output
    for row in rows:  # 2·n·S bytes over the bandwidth, as a share of the time
        bound_us = 2 * 2 * row["size_bytes"] / (memory["gbps"] * 1e9) * 1e6
        assert row["share_of_memory_bound"] == pytest.approx(bound_us / row["time_us"]), row


@pytest.mark.parametrize("arguments, complaint", [
    (["--backends", "torus:api=op", "-c", "broadcast"], "torch.ops.torus has all_reduce_ of CPU tensors only, not broadcast"),
    (["--backends", "torus:api=ops"], "api='ops' is not one of dist, op"),
])
def test_bench_refuses_what_the_direct_op_cannot_do(arguments, complaint, capsys):
    from torch_torus.bench.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(arguments)
    assert complaint in capsys.readouterr().err


def test_tune_writes_an_entry_for_the_job_and_prints_it(tmp_path):
    path = tmp_path / "tuning.json"
    output = run_torchrun(["-m", "torch_torus.tune", "-b", "4K", "-e", "1M", "-f", "16", "-n", "2", "-w", "1",
                           "-r", "2", "--min-round-ms", "5", "-o", str(path)])
    assert "2 ranks, no grid, 1 host(s) with 2 ranks, over shm" in output, output
    assert "round/s" not in output, output  # no progress bar where stderr is not a terminal
    [entry] = tuning.read(str(path))
    assert entry.layout == tuning.Layout(2, None, (2,), "shm")
    assert "# host memory: " in output and entry.record["host_memory"]["gbps"] > 0, entry.record
    measured = entry.record["measured"]
    assert measured["sizes"] == [4096, 65536, 1 << 20]
    times = measured["time_us"]
    assert set(times) >= {"ring", "one_shot", "two_shot"}  # what auto may choose over shm
    # one_shot's group runs two_shot above its 512 KiB shared-memory slot: not measured there.
    assert times["one_shot"][2] is None
    assert all(t > 0 for algorithm, ts in times.items() for t in (ts[:2] if algorithm == "one_shot" else ts))
    assert entry.allreduce == tuning.rules_from_measurements(measured["sizes"], measured["time_us"])
    printed = subprocess.run([sys.executable, "-m", "torch_torus.tune", "--print", str(path)], cwd=REPOSITORY,
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": REPOSITORY})
    assert f'TORUS_ALLREDUCE="{entry.range_string}"' in printed.stdout, printed


def test_small_sizes_get_more_calls_per_round():
    # 1 ms calls: 50 of them; 0.1 ms: capped at 100 x iters; 100 ms: never fewer than --iters.
    assert timing.calls_per_round([1e-3, 1e-4, 0.1], iters=5, min_round_ms=50.0) == [50, 500, 5]


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_rounds_time_each_contender_in_a_new_order_and_keep_its_best_round(one_rank_group, monkeypatch):
    # Each contender's seconds per call in rounds 0, 1, 2, as time_calls would measure them.
    script = [[3e-3, 1e-3, 2e-3], [1e-4, 2e-4, 5e-5], [0.2, 0.1, 0.3]]
    timed = []  # (contender, calls) in the order timed

    def scripted_time_calls(call, calls, warmup, bootstrap, synchronize):
        index = call()
        round_index = sum(1 for done, _ in timed if done == index)
        timed.append((index, calls))
        return script[index][round_index]

    monkeypatch.setattr(timing, "time_calls", scripted_time_calls)
    resets, finished = [], []
    plan = timing.RoundPlan(iters=5, warmup=1, rounds=3, min_round_ms=50.0)
    best = timing.best_round_seconds([lambda: 0, lambda: 1, lambda: 2], plan, one_rank_group,
                                     reset=lambda: resets.append(True), timed=finished.append)

    assert best == [1e-3, 5e-5, 0.1]
    order = [index for round_index in range(3) for index in timing.round_order(3, round_index)]
    assert [index for index, _ in timed] == order == finished
    assert len(resets) == 9  # every contender's round starts from reset data
    # --iters in the first round, then enough to last --min-round-ms: 17 of 3 ms, 500 (the cap) of
    # 0.1 ms, never fewer than --iters.
    calls = {index: [count for done, count in timed if done == index] for index in range(3)}
    assert calls == {0: [5, 17, 17], 1: [5, 500, 500], 2: [5, 5, 5]}


def _column_names(lines: list[str]) -> str:
    """The table's line of column names."""
    [names] = [line for line in lines if line.lstrip("# ").startswith("size") and "#wrong" in line]
    return names


def _row(lines: list[str], size: int) -> str:
    """The table's row of `size` bytes."""
    [row] = [line for line in lines if line.split()[:1] == [str(size)] and "float32" in line]
    return row


def _report(args, tmp_path):
    """The bench's report (header, table, summary) and JSON for two sizes of two contenders whose
    times are made up, as rank 0 would print and write them."""
    from torch_torus.bench.collectives import COLLECTIVES
    from torch_torus.bench.measure import Row
    from torch_torus.bench.report import Table, header, summary, write_json

    collective = COLLECTIVES["allreduce"](4, 0, 0)
    copy = getattr(args, "device_copy", None)
    memory = getattr(args, "host_memory", None)
    rows_by_size = []
    for size, times_us in ((4096, (50.0, 80.0)), (1 << 28, (200.0, 800.0))):
        rows = []
        for contender, time_us in zip(args.contenders, times_us):
            algbw = size / (time_us * 1e-6) / 1e9
            busbw = algbw * collective.bus_factor()
            rows.append(Row(contender=contender, size_bytes=size, count=size // 4, time_us=time_us, algbw=algbw,
                            busbw=busbw, wrong=0, algorithm=None,
                            copy_share=busbw / copy.gbps if copy is not None else None,
                            memory_share=(memory.bound_seconds(collective.memory_bytes(size)) / (time_us * 1e-6)
                                          if memory is not None else None)))
        rows_by_size.append(rows)
    table = Table(collective, args)
    lines = (header(collective, args, ["host"] * 4) + table.header_lines()
             + [table.row_line(rows) for rows in rows_by_size] + summary(rows_by_size, args))
    path = tmp_path / "bench.json"
    write_json(str(path), collective, args, ["host"] * 4, rows_by_size)
    return lines, json.loads(path.read_text())


def test_bench_on_cuda_reports_each_busbw_as_a_share_of_the_device_copy(tmp_path):
    from torch_torus.bench.cli import parse_args
    from torch_torus.bench.timing import DeviceCopy

    args = parse_args(["--backends", "gloo;mpi", "--device", "cpu"])  # mpi: no algorithm column
    lines, document = _report(args, tmp_path)
    assert not any("%copy" in line or "device-to-device" in line for line in lines), lines
    assert "device_copy" not in document
    assert all("busbw_share_of_device_copy" not in row for row in document["rows"])

    args.device = "cuda"
    args.device_copy = DeviceCopy(gbps=3000.0, nbytes=256 << 20, device="cuda:0 (a GPU)", rounds=5, copies=10)
    lines, document = _report(args, tmp_path)
    text = "\n".join(lines)
    assert "# device-to-device copy on rank 0's GPU, cuda:0 (a GPU): 3000.0 GB/s" in text, text
    assert "256MiB" in text, text
    assert _column_names(lines).count("%copy") == 2, lines
    # 256 MiB in 200 us: algbw 1342.2 GB/s, busbw x 1.5 = 2013.3 GB/s = 67.11 % of 3000 GB/s; the other 4x slower.
    big = _row(lines, 1 << 28)
    assert "67.11" in big.split() and "16.78" in big.split(), big
    assert "# Avg bus bandwidth as % of the device copy (3000.0 GB/s):" in text, text
    assert document["device_copy"]["gbps"] == 3000.0 and document["device_copy"]["bytes"] == 256 << 20
    shares = [row["busbw_share_of_device_copy"] for row in document["rows"]]
    assert shares == pytest.approx([row["busbw_gbps"] / 3000.0 for row in document["rows"]])


def test_bench_on_one_cpu_host_reports_the_memory_bound_as_a_share_of_each_time(tmp_path):
    from torch_torus.bench.cli import parse_args
    from torch_torus.bench.memory_bound import HostMemory

    args = parse_args(["--backends", "gloo;mpi"])
    args.host_memory = HostMemory(nbytes=64 << 20, processes=2, rounds=5, copies=4, plain_gbps=12.5,
                                  streaming_gbps=20.0)
    lines, document = _report(args, tmp_path)
    text = "\n".join(lines)
    assert "# host memory: 20.0 GB/s, bytes read + written per second by 2 ranks at once" in text, text
    assert "(streaming stores 20.0, plain stores 12.5: the faster counts)" in text, text
    assert "2·n·S / 20.0 GB/s" in text, text
    assert _column_names(lines).count("%mem") == 2, lines
    # 4 KiB on 4 ranks: 2·4·4 KiB through memory at 20 GB/s take 1.64 us; in 50 us, 3%; in 80 us, 2%.
    small = _row(lines, 4096)
    assert small.split()[9] == "3" and small.split()[14] == "2", small
    assert document["host_memory_bandwidth"] == {"gbps": 20.0, "plain_gbps": 12.5, "streaming_gbps": 20.0,
                                                 "bytes_per_process": 64 << 20, "processes": 2, "rounds": 5,
                                                 "copies_per_round": 4}
    shares = [row["share_of_memory_bound"] for row in document["rows"]]
    assert shares == pytest.approx([8 * row["size_bytes"] / 20e9 / (row["time_us"] * 1e-6) for row in document["rows"]])


def test_memory_bound_counts_each_input_read_and_each_output_written_once():
    from torch_torus.bench.collectives import COLLECTIVES

    size, n = 1 << 20, 4
    expected = {"allreduce": 2 * n * size, "alltoall": 2 * n * size, "broadcast": n * size,
                "allgather": (n + 1) * size, "reduce_scatter": (n + 1) * size}
    assert {name: cls(n, 0, 0).memory_bytes(size) for name, cls in COLLECTIVES.items()} == expected


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no GPU is visible to torch")
def test_device_copy_bandwidth_is_measured_on_the_gpu():
    import torch

    from torch_torus.bench.timing import device_copy_bandwidth

    copy = device_copy_bandwidth(torch.device("cuda", 0), nbytes=64 << 20, rounds=2, copies=3)
    # Any GPU that runs CUDA copies device memory faster than 10 GB/s, and none at 100 TB/s.
    assert 10 < copy.gbps < 100_000, copy
    assert copy.device.startswith("cuda:0 (") and copy.nbytes == 64 << 20
