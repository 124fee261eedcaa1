"""The bench under torchrun: 2 ranks, tiny sizes, several rounds, every result checked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_BOUND_S = 180


def test_rounds_time_every_contender_in_turn_and_report_the_best(tmp_path):
    json_path = tmp_path / "bench.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "0",
               "-m", "torch_torus.bench", "--backends", "torus:allreduce=ring;torus:allreduce=recursive_doubling;gloo",
               "-b", "1K", "-e", "16K", "-f", "4", "-n", "2", "-w", "1", "-R", "3", "--check",
               "--json", str(json_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPOSITORY, os.environ.get("PYTHONPATH")]))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    process = subprocess.Popen(command, env=env, cwd=REPOSITORY, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=RUN_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the bench did not finish within {RUN_BOUND_S} s:\n{output}")
    assert process.returncode == 0, output
    assert "3 rounds of every contender in turn, the best round counts" in output, output
    assert "# Out of bounds values : 0 OK" in output, output
    assert "options: allreduce=ring, over shm" in output, output  # 2 ranks on one host: auto takes shm
    document = json.loads(json_path.read_text())
    assert document["rounds"] == 3
    rows = document["rows"]
    assert sorted({row["size_bytes"] for row in rows}) == [1024, 4096, 16384]
    assert len(rows) == 9 and all(row["wrong"] == 0 and row["time_us"] > 0 for row in rows), rows
