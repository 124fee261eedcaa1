"""torchft (fault-tolerant DDP) over torus: torch_torus.torchft.ProcessGroupTorus.

torchft's lighthouse runs in this process; two replicas (tests/torchft_jobs.py, one process each)
train through torchft's Manager. One replica is SIGKILLed between steps, or inside the gradient
allreduce while the other's is in flight, and started again: it heals from the other (torchft's
checkpoint transfer), the group is created again over torchft's store, and both train to the end.
The final parameters are the same on both replicas and the same as the run with torchft's
ProcessGroupGloo under the same kill schedule. Every process is bounded by RUN_TIMEOUT and killed
at the end. Tested with torchft 0.2.0 (configure) and torchft-nightly 2026.10.26 (set_rank_info and
reconfigure); skips without torchft. About 3 min on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest

pytest.importorskip("torchft")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchft._torchft import LighthouseServer  # noqa: E402

from torch_torus.torchft import ProcessGroupTorus  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "torchft_jobs.py")
STEPS, KILL_STEP = 6, 3
# One run: two replicas, a restart, the heal; generous for a loaded 2-core machine.
RUN_TIMEOUT = 240.0


def _replica(backend: str, replica: int, lighthouse: str, scratch, kill: str = "") -> subprocess.Popen:
    log = open(scratch / f"replica{replica}.log", "a")
    name, _, transport = backend.partition("+")
    command = [sys.executable, JOB, "--backend", name, "--replica", str(replica), "--lighthouse", lighthouse,
               "--steps", str(STEPS), "--scratch", str(scratch)]
    env = dict(os.environ, TORUS_TRACE_DIR=str(scratch / "trace"))
    if transport:
        env["TORUS_TRANSPORT"] = transport
    with log:
        return subprocess.Popen(command + (["--kill", kill] if kill else []), stdout=log, stderr=subprocess.STDOUT,
                                env=env)


def _wait(process: subprocess.Popen, deadline: float, what: str, scratch) -> int:
    try:
        return process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(scratch.glob("replica*.log")))
        pytest.fail(f"{what} still running after {RUN_TIMEOUT} s\n{logs}")


def _run(backend: str, where: str, victim: int, tmp_path) -> list[dict]:
    """Trains two replicas over `backend` ("gloo", or "torus+<transport>"); `victim` SIGKILLs itself at KILL_STEP (`where`: between
    steps or in the allreduce) and is started again. Each replica's result, in replica order."""
    scratch = tmp_path / f"{backend}-{where}"
    scratch.mkdir()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=200)
    processes = []
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        processes = [_replica(backend, r, lighthouse.address(), scratch, f"{where}:{KILL_STEP}" if r == victim else "")
                     for r in range(2)]
        status = _wait(processes[victim], deadline, f"replica {victim} (to be killed)", scratch)
        assert status == -signal.SIGKILL, f"replica {victim} ended with {status}, not killed: see {scratch}"
        processes[victim] = _replica(backend, victim, lighthouse.address(), scratch)
        for replica, process in enumerate(processes):
            status = _wait(process, deadline, f"replica {replica}", scratch)
            assert status == 0, f"replica {replica} ended with {status}: {(scratch / f'replica{replica}.log').read_text()[-3000:]}"
        results = [json.loads((scratch / f"replica{r}.json").read_text()) for r in range(2)]
        for result in results:
            result["dumps"] = sorted(str(p) for p in (scratch / "trace").rglob("*.json"))
        return results
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        lighthouse.shutdown()


@pytest.mark.parametrize("where,victim", [("between", 1), ("allreduce", 0)])
def test_replica_killed_heals_and_matches_gloo(where, victim, tmp_path):
    """Replica 1 dies between steps; replica 0 (which hosts the quorum's store) dies in the gradient
    allreduce while replica 1's is in flight. The survivor's torus group is aborted and created
    again with the restarted replica, which heals; the result is gloo's, bit for bit, over shm and
    over tcp."""
    gloo = _run("gloo", where, victim, tmp_path)
    survivor = 1 - victim
    assert gloo[0]["parameters"] == gloo[1]["parameters"]
    for backend in ("torus+shm", "torus+tcp"):
        torus = _run(backend, where, victim, tmp_path)
        assert torus[0]["parameters"] == torus[1]["parameters"], backend
        assert torus[0]["parameters"] == gloo[0]["parameters"], backend
        if where == "allreduce":
            # The survivor's allreduce failed when its peer died, and that step was not committed;
            # the failure left the survivor's flight recorder.
            assert torus[survivor]["errored"] and KILL_STEP in torus[survivor]["uncommitted"], (backend, torus)
            assert any(dump.endswith(f"rank{survivor}.json") for dump in torus[survivor]["dumps"]), (backend, torus)
        else:
            # torchft aborted the survivor's group at the quorum change with nothing in flight.
            assert torus[survivor]["dumps"] == [], (backend, torus[survivor]["dumps"])


def _configure(pg: ProcessGroupTorus, port: int, quorum: int, rank: int) -> None:
    """Creates the group for a quorum of 2 as torchft's Manager does: torchft 0.2.0's configure, or
    its later releases' set_rank_info and reconfigure (by torchft's reconfigure_with_store, which
    exchanges the reconfigure handles in the store)."""
    address = f"localhost:{port}/torchft/{quorum}/0"
    if hasattr(pg, "configure"):
        pg.configure(address, str(rank), rank, 2, quorum, 0, 1, [0, 1])
    else:
        from torchft.process_group import reconfigure_with_store

        pg.set_rank_info(str(rank), 0, 1, rank)
        reconfigure_with_store(pg, address, rank, 2)


def _configure_job(rank: int, port: int, queue) -> None:
    try:
        pg = ProcessGroupTorus(timeout=timedelta(seconds=20))
        results = []
        for quorum in range(2):
            _configure(pg, port, quorum, rank)
            t = torch.full((3,), float(rank + 1 + quorum))
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            pg.allreduce([t], opts).wait()
            out = torch.zeros(2)
            pg.reduce_scatter_tensor_coalesced([out], [torch.arange(4.0)], dist.ReduceScatterOptions()).wait()
            results.append((t.tolist(), out.tolist(), pg.errored()))
            # torchft's quorum change comes once every replica has finished the step.
            store = dist.TCPStore("localhost", port, is_master=False, wait_for_workers=False)
            store.set(f"done/{quorum}/{rank}", "1")
            store.wait([f"done/{quorum}/{1 - rank}"])
        started = time.monotonic()
        pg.abort(errored=False)
        queue.put((rank, (results, pg.getBackendName(), time.monotonic() - started, str(pg.errored()))))
    except Exception as error:  # reported to the test, which fails naming it
        queue.put((rank, repr(error)))


def test_configure_collectives_abort(tmp_path):
    """torchft creates the torus group over its store prefix, again for each quorum; reduce_scatter works (torchft's gloo wrapper refuses it); a planned abort
    returns at once and writes no flight-recorder dump."""
    import multiprocessing

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    os.environ["TORUS_TRACE_DIR"], trace = str(tmp_path / "trace"), os.environ.get("TORUS_TRACE_DIR")
    try:
        processes = [context.Process(target=_configure_job, args=(rank, store.port, queue)) for rank in range(2)]
        for process in processes:
            process.start()
        results = dict(queue.get(timeout=120) for _ in processes)
    finally:
        os.environ.pop("TORUS_TRACE_DIR")
        if trace is not None:
            os.environ["TORUS_TRACE_DIR"] = trace
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    for rank in range(2):
        assert not isinstance(results[rank], str), f"rank {rank}: {results[rank]}"
        steps, name, abort_seconds, errored = results[rank]
        assert steps == [([3.0] * 3, [4.0 * rank, 4.0 * rank + 2], None), ([5.0] * 3, [4.0 * rank, 4.0 * rank + 2], None)]
        assert name == "torchft-torus"
        assert abort_seconds < 5.0  # a generous bound: no wait on anything
        assert "aborted" in errored  # as torchft's NCCL wrapper: errored() after an abort
    assert not (tmp_path / "trace").exists() or not any((tmp_path / "trace").rglob("*.json"))
