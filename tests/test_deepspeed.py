"""DeepSpeed ZeRO-1 and ZeRO-3 on CPU over torus, against the same jobs over gloo.

Each job is 2 ranks of tests/deepspeed_jobs.py (fresh processes, DS_ACCELERATOR=cpu), each bounded
by JOB_TIMEOUT and killed at the end. DeepSpeed compiles its CPU shared-memory op
(deepspeed_shm_comm) the first time any job runs on a machine, about a minute on 2 cores, and
reuses it from ~/.cache/torch_extensions after. Six jobs of 6-30 s each (1-3 min on a loaded
2-core machine) once it is built.
Skips without deepspeed (pip install --no-build-isolation deepspeed with DS_ACCELERATOR=cpu)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "deepspeed_jobs.py")
# The first job on a machine compiles DeepSpeed's op: minutes on a loaded 2-core machine.
JOB_TIMEOUT = 600
WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_job(backend: str, stage: int, directory) -> list[dict]:
    """Runs the job's ranks to their end; each rank's JSON result, in rank order."""
    port = _free_port()
    ranks = []
    try:
        for rank in range(WORLD_SIZE):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
            out = directory / f"{backend.replace(':', '_')}-{stage}-{rank}"
            log = open(f"{out}.log", "w")
            ranks.append((subprocess.Popen([sys.executable, JOB, "--backend", backend, "--stage", str(stage),
                                            "--out", f"{out}.json"], env=env, stdout=log, stderr=subprocess.STDOUT),
                          out, log))
        for rank, (process, out, _) in enumerate(ranks):
            try:
                status = process.wait(timeout=JOB_TIMEOUT)
            except subprocess.TimeoutExpired:
                status = f"still running after {JOB_TIMEOUT} s"
            # gloo's ranks (the reference, and DeepSpeed's default) were seen to die of SIGABRT at
            # interpreter exit after writing their results ("terminate called without an active
            # exception", a thread of theirs meeting Python's end): the reference still counts.
            # torus's ranks must exit 0.
            aborted_after_result = (status == -signal.SIGABRT and backend in ("gloo", "default")
                                    and os.path.exists(f"{out}.json"))
            if status != 0 and not aborted_after_result:
                with open(f"{out}.log") as log:
                    tail = log.read()[-3000:]
                pytest.fail(f"{backend} ZeRO-{stage}: rank {rank} ended with {status}:\n{tail}")
        results = []
        for _, out, _ in ranks:
            with open(f"{out}.json") as result:
                results.append(json.load(result))
        return results
    finally:
        for process, _, log in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_over_torus_equals_gloo(stage, tmp_path):
    torus = _run_job("torus", stage, tmp_path)
    gloo = _run_job("gloo", stage, tmp_path)
    for results, backend in ((torus, "torus"), (gloo, "gloo")):
        assert [(r["backend"], r["backend_in_use"]) for r in results] == [(backend, backend)] * WORLD_SIZE
    for rank in range(WORLD_SIZE):
        assert len(torus[rank]["losses"]) == 5
        # Two ranks' sums are the same in any order: torus and gloo agree bit for bit.
        assert torus[rank]["losses"] == gloo[rank]["losses"], f"rank {rank}'s losses"
        assert torus[rank]["parameters"] == gloo[rank]["parameters"], f"rank {rank}'s parameters"
    assert torus[0]["parameters"] == torus[1]["parameters"]
    assert torus[0]["losses"] != torus[1]["losses"]  # each rank trained on its own data


def test_backend_is_the_one_asked_for(tmp_path):
    """DeepSpeed runs on torus when the group is created with it, by deepspeed.init_distributed or
    torch.distributed.init_process_group; without either, deepspeed.initialize creates the group
    itself on the CPU accelerator's choice, gloo (ccl where oneCCL's binding is installed): torus
    must be asked for."""
    for backend, expected in (("torch:torus", "torus"), ("default", "gloo")):
        results = _run_job(backend, 1, tmp_path)
        assert [(r["backend"], r["backend_in_use"]) for r in results] == [(expected, expected)] * WORLD_SIZE, backend
