"""Across hosts: a cluster of 2 emulated hosts x 2 ranks on this machine (benchmarks/cluster:
a network namespace per host, veths on a bridge, links shaped to 1 Gbit/s with tc tbf), so
TORUS_TRANSPORT=auto picks TCP between hosts and the torus grid has one row per host.

* allreduce with ring and torus, each rank's result against the one-process reference, started
  by torchrun on each host (tests/cluster_case.py), between hosts over TCP, over OFI (libfabric's
  tcp provider) and over OFI alone;
* the bench, briefly, with --check, started as srun would start it (the emulator's stand-in for
  srun sets SLURM_* and no MASTER_ADDR: torch_torus.launch derives them), and under a real
  mpiexec with MPI as a contender and torus over OFI beside it (skipped without mpi4py);
* the emulator leaves nothing behind, also when it is stopped by SIGTERM.

Needs root, `ip netns`, tc and unshare; skips saying which is missing. Every run is bounded
(the emulator's own --timeout and a subprocess timeout above it) and its namespaces are removed
whatever happens.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import harness  # noqa: E402
from benchmarks.cluster import emulate, enter_host, launchers, links, namespaces  # noqa: E402

CASE = Path(__file__).resolve().with_name("cluster_case.py")
RUN_LIMIT = 90  # seconds the emulator gives its hosts; the subprocess gets 30 more


@pytest.fixture(scope="module")
def cluster_available():
    """Skip unless a 1-host shaped cluster can be brought up and down here."""
    probe = namespaces.Cluster(1, links.parse_rate("1gbit"), run_id=os.getpid())
    try:
        probe.up()
    except namespaces.ClusterError as error:
        pytest.skip(f"cannot emulate a cluster here: {error}")
    except OSError as error:  # /etc/netns not writable and the like
        pytest.skip(f"cannot emulate a cluster here: {error}")
    finally:
        probe.down()


def run_cluster(args: list[str], tmp_path: Path, limit: float = RUN_LIMIT) -> tuple[int, str, Path]:
    """`python -m benchmarks.cluster ARGS` with --results under tmp_path, bounded; the run's
    namespaces are removed afterwards even if it had to be killed. Returns (exit status,
    everything it printed, results folder)."""
    results = tmp_path / "results"
    command = [sys.executable, "-m", "benchmarks.cluster", "--timeout", str(limit), "--grace", "10",
               "--results", str(results), *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=limit + 30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the emulator tears down on SIGTERM
        try:
            output, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        output = f"{output}\n[test] the emulator overran {limit + 30:g} s and was stopped"
    finally:
        left = namespaces.cleanup(pid=proc.pid)
    assert not left, f"the emulator left namespaces behind: {left}\n{output}"
    return proc.returncode, output, results


# TORUS_TRANSPORT, what the group says it runs over, and how it describes the network between hosts.
TRANSPORTS = [
    ("auto", "shm+tcp", "shared memory inside each host, tcp between hosts (10.213.0.1)"),
    ("shm+ofi", "shm+ofi", "shared memory inside each host, ofi: tcp;ofi_rxm on eth0"),
    ("ofi", "ofi", "over ofi: tcp;ofi_rxm on eth0"),
]


@pytest.mark.parametrize("setting, transport, described", TRANSPORTS, ids=[t[0] for t in TRANSPORTS])
def test_allreduce_ring_and_torus_across_hosts(cluster_available, tmp_path, setting, transport, described):
    if "ofi" in setting and harness.without_ofi():
        pytest.skip(harness.without_ofi())
    status, output, results = run_cluster(
        ["--hosts", "2", "--nproc-per-host", "2", "--link", "1gbit", "--env", f"TORUS_TRANSPORT={setting}",
         "--env", "TORUS_OFI_PROVIDER=tcp", "--env", "TORUS_LOG_LEVEL=info", "--", str(CASE)], tmp_path)
    assert status == 0, output
    lines = re.findall(r"^CLUSTER-CASE rank (\d+) (.*)$", output, re.MULTILINE)
    assert sorted(int(rank) for rank, _ in lines) == [0, 1, 2, 3], output
    for rank, verdict in lines:
        assert verdict.startswith("ok "), f"rank {rank}: {verdict}"
        # Two hosts by name and network namespace; torus ran as torus (2x2, one row per host).
        assert "ring:ring torus:torus hosts=2" in verdict, verdict
    log = (results / "node0.stderr").read_text()
    assert f"4 ranks on 2 host(s) over {transport}, torus grid 2x2 (one row per host)" in log, log
    # Shared memory inside each host (but for ofi alone); rank 0's address routes to MASTER_ADDR.
    assert described in log, log


def test_bench_across_hosts_under_srun(cluster_available, tmp_path):
    status, output, results = run_cluster(
        ["--hosts", "2", "--nproc-per-host", "2", "--link", "1gbit", "--launcher", "srun", "--",
         sys.executable, "-m", "torch_torus.bench", "-b", "4K", "-e", "1M", "-f", "16", "-n", "2",
         "-w", "1", "--check", "--backends", "torus:allreduce=ring;torus:allreduce=torus;gloo"],
        tmp_path)
    assert status == 0, output
    assert "# 4 ranks on 2 hosts: node0 (2), node1 (2)" in output, output
    rows = re.findall(r"^\s+(4096|65536|1048576)\s+\d+\s+float32\s+sum\s+-1\s+(.*)$", output,
                      re.MULTILINE)
    assert [size for size, _ in rows] == ["4096", "65536", "1048576"], output
    for size, row in rows:
        columns = row.split()
        # time algbw busbw #wrong [algorithm] for each of ring, torus, gloo
        wrong = [columns[3], columns[8], columns[13]]
        assert wrong == ["0", "0", "0"], f"{size}: {row}"
        assert (columns[4], columns[9]) == ("ring", "torus"), f"{size}: {row}"


def test_bench_across_hosts_under_mpiexec(cluster_available, tmp_path):
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install -e '.[mpi]')")
    if launchers.default_mpiexec() is None:
        pytest.skip("no mpiexec beside this Python or on PATH (pip install -e '.[mpi]')")
    backends = "torus:transport=tcp;gloo;mpi"
    if harness.without_ofi() is None:
        backends += ";torus:transport=ofi"
    status, output, results = run_cluster(
        ["--hosts", "2", "--nproc-per-host", "1", "--launcher", "mpiexec",
         "--env", "UCX_TLS=tcp,self", "--env", "UCX_NET_DEVICES=eth0",
         "--env", "OMPI_ALLOW_RUN_AS_ROOT=1", "--env", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1", "--",
         sys.executable, "-m", "torch_torus.bench", "-b", "4K", "-e", "64K", "-f", "16", "-n", "2",
         "-w", "1", "--check", "--backends", backends], tmp_path)
    assert status == 0, output
    # One rank in each namespace, started by mpiexec through enter_host.py.
    assert "# 2 ranks on 2 hosts: node0 (1), node1 (1)" in output, output
    assert re.search(r"\[3\] mpi +(MPICH|Open MPI)", output), output
    rows = re.findall(r"^\s+(4096|65536)\s+\d+\s+float32\s+sum\s+-1\s+(.*)$", output, re.MULTILINE)
    assert [size for size, _ in rows] == ["4096", "65536"], output
    for size, row in rows:
        columns = row.split()
        # time algbw busbw #wrong algorithm (torus), then time algbw busbw #wrong (gloo, mpi)
        wrong = [columns[3], columns[8], columns[12]] + ([columns[16]] if len(columns) > 16 else [])
        assert set(wrong) == {"0"}, f"{size}: {row}"


@pytest.mark.parametrize("argv, host, command", [
    (["node1", "orted", "--x"], "node1", "orted --x"),
    (["-x", "node0", "hydra_pmi_proxy", "--control-port", "node0:1"], "node0",
     "hydra_pmi_proxy --control-port node0:1"),
    (["-l", "root", "-o", "BatchMode=yes", "node1", "true"], "node1", "true"),
])
def test_enter_host_reads_an_ssh_command_line(argv, host, command):
    argv_run = enter_host.command_for(argv, {"node0": "torus-h0-1", "node1": "torus-h1-1"})
    assert argv_run[:4] == ["ip", "netns", "exec", f"torus-h{host[-1]}-1"]
    assert argv_run[-2:] == [host, command]


def test_enter_host_names_an_unknown_host():
    with pytest.raises(SystemExit, match="'node7' is not in the emulated cluster"):
        enter_host.command_for(["node7", "true"], {"node0": "torus-h0-1"})


def test_teardown_on_sigterm(cluster_available, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.cluster", "--hosts", "2", "--link", "100mbit",
         "--launcher", "none", "--timeout", "60", "--results", str(tmp_path), "--",
         "sleep", "50"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(namespaces.leftovers(pid=proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(namespaces.leftovers(pid=proc.pid)) == 3  # the bridge's and 2 hosts'
        time.sleep(0.5)  # the hosts' commands are starting
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        left = namespaces.cleanup(pid=proc.pid)
    assert not left, f"left behind after SIGTERM: {left}\n{output}"
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert "interrupted by SIGTERM; taking the cluster down" in output, output


def test_without_root_the_emulator_says_so(monkeypatch):
    monkeypatch.setattr(namespaces.os, "geteuid", lambda: 1000)
    with pytest.raises(namespaces.ClusterError, match="needs root"):
        namespaces.require_root_tools()
    assert emulate.main(["--hosts", "2", "--", "true"]) == 2


@pytest.mark.parametrize("text, bits", [("1gbit", 1e9), ("500mbit", 5e8), ("125mbps", 1e9),
                                         ("none", None)])
def test_link_rates(text, bits):
    assert links.parse_rate(text) == bits


def test_tasks_per_node_as_slurm_writes_it():
    assert launchers.tasks_per_node([4, 4, 4]) == "4(x3)"
    assert launchers.tasks_per_node([2, 2, 1]) == "2(x2),1"
