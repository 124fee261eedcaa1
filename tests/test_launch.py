"""torch_torus.launch: torch's env:// variables from MPICH's and Open MPI's mpiexec and from
Slurm's srun, in one process, with the environment and the MPI communicator played by
stand-ins; init_from_mpi/init_from_slurm/init_from_launcher up to a one-rank torus group; the
TCP address the backend picks: from the group's store, or TORUS_SOCKET_IFNAME's interface."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from types import SimpleNamespace

import psutil
import pytest

import torch
import torch.distributed as dist

import torch_torus
from torch_torus.config import ConfigError
from torch_torus.launch import (MpiLaunch, MpiLaunchError, SlurmLaunch, SlurmLaunchError,
                                _start_rendezvous_store, expand_hostlist, expand_tasks_per_node,
                                init_env_from_launcher, init_env_from_mpi, init_env_from_slurm,
                                mpi_launch_from_env, slurm_launch_from_env)
from torch_torus.network import local_address
from torch_torus.topology import (FAILED, Meeting, agree, describe_failures, failures_of, meeting_of,
                                  meeting_record, rendezvous_environ)

# What each mpiexec sets for the second of four ranks on one host (seen with MPICH 5.0.2's
# and Open MPI 5.0.11's mpiexec from PyPI), trimmed to the variables read.
OPEN_MPI_RANK_1 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
                   "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                   "PMIX_RANK": "1"}
MPICH_RANK_1 = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4",
                "PMI_FD": "9"}


class FakeComm:
    """The part of an mpi4py communicator that init_env_from_mpi uses, as seen by one rank:
    allgather answers `hostnames`, bcast from rank 0 answers `broadcast` on other ranks."""

    def __init__(self, rank: int, size: int, hostnames: list[str], broadcast=None):
        self.rank, self.size, self.hostnames, self.broadcast = rank, size, hostnames, broadcast

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def allgather(self, value):
        assert value == self.hostnames[self.rank]
        return self.hostnames

    def bcast(self, value, root):
        assert root == 0
        return value if self.rank == 0 else self.broadcast


@pytest.mark.parametrize("environ, launcher", [(OPEN_MPI_RANK_1, "Open MPI"),
                                               (MPICH_RANK_1, "MPICH (Hydra)")])
def test_launch_from_each_mpiexec(environ, launcher):
    assert mpi_launch_from_env(environ) == MpiLaunch(launcher, rank=1, world_size=4, local_rank=1,
                                                     local_world_size=4)


def test_no_launcher_gives_none():
    assert mpi_launch_from_env({"RANK": "0", "WORLD_SIZE": "2"}) is None


@pytest.mark.parametrize("change, message", [
    ({"PMI_SIZE": "four"}, "PMI_SIZE='four' is not an integer"),
    ({"PMI_RANK": "4"}, "PMI_RANK=4 is not a rank of PMI_SIZE=4"),
    ({"MPI_LOCALRANKID": "-1"}, "MPI_LOCALRANKID=-1 is not a rank of MPI_LOCALNRANKS=4"),
    ({"MPI_LOCALNRANKS": None}, "PMI_RANK is set, as MPICH \\(Hydra\\)'s mpiexec does, but "
                                "MPI_LOCALNRANKS is not"),
])
def test_bad_launcher_variables_are_named(change, message):
    environ = {**MPICH_RANK_1, **change}
    environ = {name: value for name, value in environ.items() if value is not None}
    with pytest.raises(MpiLaunchError, match=message):
        mpi_launch_from_env(environ)


def test_rank_0_picks_loopback_and_the_port_of_a_store_it_started_on_one_host():
    environ = {**OPEN_MPI_RANK_1, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    host = socket.gethostname()
    init_env_from_mpi(FakeComm(0, 4, [host] * 4), environ)
    assert environ["MASTER_ADDR"] == "127.0.0.1"
    # A store answers there already: the port was never released for another process to take.
    client = dist.TCPStore("127.0.0.1", int(environ["MASTER_PORT"]), is_master=False, wait_for_workers=False)
    client.set("probe", "1")
    assert client.get("probe") == b"1"
    assert (environ["RANK"], environ["WORLD_SIZE"], environ["LOCAL_RANK"],
            environ["LOCAL_WORLD_SIZE"]) == ("0", "4", "0", "4")


def test_other_ranks_take_rank_0s_choice():
    environ = dict(MPICH_RANK_1)
    init_env_from_mpi(FakeComm(1, 4, ["a", socket.gethostname(), "b", "b"],
                               broadcast=("a", 29501)), environ)
    assert (environ["MASTER_ADDR"], environ["MASTER_PORT"], environ["RANK"]) == ("a", "29501", "1")


def test_several_hosts_rendezvous_at_rank_0s_host_name():
    environ = {**MPICH_RANK_1, "PMI_RANK": "0", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    init_env_from_mpi(FakeComm(0, 4, [socket.gethostname(), "x", "y", "y"]), environ)
    assert environ["MASTER_ADDR"] == socket.gethostname()


def test_master_address_and_port_already_set_are_kept_without_mpi4py():
    environ = {**MPICH_RANK_1, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29400"}
    init_env_from_mpi(None, environ)
    assert (environ["MASTER_ADDR"], environ["MASTER_PORT"], environ["RANK"]) == \
        ("10.0.0.7", "29400", "1")


def test_mpi4py_on_another_mpi_than_the_launcher_is_reported():
    # MPICH's mpiexec running Open MPI's library: each process is rank 0 of 1.
    with pytest.raises(MpiLaunchError, match="rank 1 of 4, but mpi4py's COMM_WORLD here is rank 0 "
                                             "of 1: mpi4py runs on another MPI library"):
        init_env_from_mpi(FakeComm(0, 1, [socket.gethostname()]), dict(MPICH_RANK_1))


def test_not_started_by_mpiexec_is_reported():
    with pytest.raises(MpiLaunchError, match="not started by mpiexec"):
        init_env_from_mpi(FakeComm(0, 1, [socket.gethostname()]), {"RANK": "0"})


# --------------------------------------------------------------------------------------------
# srun

# What srun sets for task 5 of `srun -N 2 --ntasks-per-node 4` (the sixth task: second node,
# local task 1), trimmed to the variables read and a few beside them.
SRUN_RANK_5 = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
               "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
               "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
               "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_STEP_NODELIST": "node[01-02]",
               "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURMD_NODENAME": "node02"}


@pytest.mark.parametrize("text, hosts", [
    ("node[01-04,07],gpu5", ["node01", "node02", "node03", "node04", "node07", "gpu5"]),
    ("gpu5", ["gpu5"]),
    ("node[8-10]", ["node8", "node9", "node10"]),
    ("node[08-10]", ["node08", "node09", "node10"]),
    ("a[1-2]b[3,5]", ["a1b3", "a1b5", "a2b3", "a2b5"]),
    ("x1,cn[003-004]-ib", ["x1", "cn003-ib", "cn004-ib"]),
])
def test_compressed_host_lists(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, message", [("node[01-04", "unbalanced"), ("node[4-1]", "backwards"),
                                           ("node[a-b]", "not a number"), ("", "names no host")])
def test_bad_host_lists_are_named(text, message):
    with pytest.raises(SlurmLaunchError, match=message):
        expand_hostlist(text)


def test_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(SlurmLaunchError, match="cannot read"):
        expand_tasks_per_node("2(3)")


def test_launch_from_srun():
    assert slurm_launch_from_env(SRUN_RANK_5) == SlurmLaunch(
        rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1, master_addr="node01")
    assert slurm_launch_from_env({"RANK": "0"}) is None


def test_uneven_tasks_per_node_and_the_job_variables_alone():
    environ = {"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
               "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_JOB_NODELIST": "cn[7-9]"}
    assert slurm_launch_from_env(environ) == SlurmLaunch(4, 5, 0, 1, 2, "cn7")


def test_ntasks_per_node_alone():
    environ = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2",
               "SLURM_NTASKS_PER_NODE": "4", "SLURM_NODELIST": "n[1-2]"}
    assert slurm_launch_from_env(environ) == SlurmLaunch(6, 8, 2, 4, 1, "n1")


def test_the_step_wins_over_the_job():
    # An allocation of 3 nodes, a step on the last two.
    environ = {**SRUN_RANK_5, "SLURM_NTASKS": "12", "SLURM_TASKS_PER_NODE": "4(x3)",
               "SLURM_JOB_NODELIST": "node[01-03]", "SLURM_STEP_NODELIST": "node[02-03]"}
    launch = slurm_launch_from_env(environ)
    assert (launch.world_size, launch.master_addr) == (8, "node02")


@pytest.mark.parametrize("change, message", [
    ({"SLURM_PROCID": "8"}, "SLURM_PROCID=8 is not a rank of SLURM_STEP_NUM_TASKS=8"),
    ({"SLURM_LOCALID": "x"}, "SLURM_LOCALID='x' is not an integer"),
    ({"SLURM_LOCALID": None}, "SLURM_PROCID is set, as srun does, but SLURM_LOCALID is not"),
    ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None},
     "but SLURM_STEP_NODELIST or SLURM_JOB_NODELIST or SLURM_NODELIST is not"),
    ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 is not a node of SLURM_STEP_TASKS_PER_NODE='4\\(x2\\)'"),
    ({"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_TASKS_PER_NODE": None},
     "tasks per node are unknown"),
])
def test_bad_srun_variables_are_named(change, message):
    environ = {**SRUN_RANK_5, **change}
    environ = {name: value for name, value in environ.items() if value is not None}
    with pytest.raises(SlurmLaunchError, match=message):
        slurm_launch_from_env(environ)


def test_env_from_srun_and_its_port():
    environ = dict(SRUN_RANK_5)
    init_env_from_slurm(environ)
    assert {name: environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                             "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                                             "MASTER_PORT")} == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "MASTER_ADDR": "node01", "MASTER_PORT": str(29500 + 456)}
    environ = {**SRUN_RANK_5, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "4000"}
    init_env_from_slurm(environ)
    assert (environ["MASTER_ADDR"], environ["MASTER_PORT"]) == ("10.1.2.3", "4000")
    environ = {name: value for name, value in SRUN_RANK_5.items() if name != "SLURM_JOB_ID"}
    init_env_from_slurm(environ)
    assert environ["MASTER_PORT"] == "29500"
    with pytest.raises(SlurmLaunchError, match="not started by srun"):
        init_env_from_slurm({})


# --------------------------------------------------------------------------------------------
# Whichever launcher, then init_process_group


@pytest.mark.parametrize("environ, found", [
    ({"RANK": "0", "WORLD_SIZE": "1", **SRUN_RANK_5}, "env"),  # torchrun started by srun
    ({**MPICH_RANK_1, "MASTER_ADDR": "h", "MASTER_PORT": "1", **SRUN_RANK_5}, "mpi"),
    (SRUN_RANK_5, "slurm"),
    ({"PATH": "/bin"}, None),
])
def test_the_launcher_is_recognised(environ, found):
    environ = dict(environ)
    assert init_env_from_launcher(environ) == found
    if found in ("mpi", "slurm"):
        assert {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= set(environ)


ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT")


@pytest.fixture
def clean_environ(monkeypatch):
    """os.environ without any launcher's variables; whatever the test sets is undone."""
    import os

    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHELASTIC_")):
            monkeypatch.delenv(name)
    for name in ENV_NAMES:
        monkeypatch.setenv(name, "")  # recorded, so that the values set below are removed
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("how", ["mpi", "slurm", "launcher"])
def test_init_from_a_launcher_makes_a_torus_group(clean_environ, how):
    if how == "mpi":
        for name, value in {**OPEN_MPI_RANK_1, "OMPI_COMM_WORLD_RANK": "0",
                            "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                            "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}.items():
            clean_environ.setenv(name, value)
        start = lambda: torch_torus.init_from_mpi(timeout=30,  # noqa: E731
                                                  comm=FakeComm(0, 1, [socket.gethostname()]))
    else:
        for name, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
                            "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "1",
                            "SLURM_JOB_NODELIST": "localhost",
                            # Rank 0's env:// rendezvous takes this store, started on a port the kernel picked.
                            "MASTER_PORT": str(_start_rendezvous_store("127.0.0.1"))}.items():
            clean_environ.setenv(name, value)
        start = (lambda: torch_torus.init_from_slurm(timeout=30)) if how == "slurm" else (  # noqa: E731
            lambda: torch_torus.init_from_launcher(timeout=30))
    start()
    try:
        assert dist.get_backend() == "torus"
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        t = torch.arange(5.0)
        dist.all_reduce(t)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# The TCP address: routed to the group's TCPStore; loopback across hosts fails at once; an
# interface's address, as psutil lists it


def test_the_address_routes_to_the_tcpstore():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    port = server.port
    store = dist.PrefixStore("group", dist.PrefixStore("default_pg", server))
    environ = rendezvous_environ(store, {"MASTER_ADDR": "elsewhere", "X": "1"})
    assert (environ["MASTER_ADDR"], environ["MASTER_PORT"], environ["X"]) == (
        "127.0.0.1", str(port), "1")
    assert rendezvous_environ(dist.HashStore(), {"X": "1"}) == {"X": "1"}


def test_a_loopback_address_across_hosts_is_refused():
    def meeting(*records):
        answer = meeting_of([meeting_record(host, address, ifname) for host, address, ifname in records])
        return Meeting.of(answer, len(records))

    across = meeting(("a", "127.0.0.1", "lo"), ("b", "10.0.0.2", ""))
    with pytest.raises(ConfigError, match="rank 0 would listen on 127.0.0.1, a loopback address "
                                          "\\(from TORUS_SOCKET_IFNAME='lo'\\), but the group "
                                          "spans 2 hosts"):
        across.check_addresses(0)
    with pytest.raises(ConfigError, match="rank 0 would listen on 127.0.0.1, a loopback address "
                                          "\\(rank 0's own error says where it comes from\\)"):
        across.check_addresses(1)
    meeting(("a", "127.0.0.1", ""), ("a", "127.0.0.1", "")).check_addresses(0)  # one host: fine
    with pytest.raises(ConfigError, match="rank 1 would listen on 127.0.0.1"):
        meeting(("a", "10.0.0.1", ""), ("b", "127.0.0.1", "")).check_addresses(0)


def test_the_hosts_travel_compactly():
    """Every rank reads the hosts of all; in the usual layouts (ranks of a host in a row, one
    rank per host) they travel as one number, not a list as long as the group."""
    def answer(*ids):
        return meeting_of([meeting_record(i, "10.0.0.1", "") for i in ids])

    assert answer("x", "x", "y", "y") == {"ranks_per_host": 2, "loopback": None}
    assert answer("a", "b", "c") == {"ranks_per_host": 1, "loopback": None}
    interleaved = answer("y", "x", "y", "x")
    assert interleaved == {"hosts": [0, 1, 0, 1], "loopback": None}
    assert Meeting.of(interleaved, 4).hosts == ["host0", "host1", "host0", "host1"]
    assert Meeting.of(answer("x", "x", "y", "y"), 4).hosts == ["host0", "host0", "host1", "host1"]


def _meet_in_threads(store, records: dict[int, str], size: int, decide=None) -> dict:
    """topology.agree on a HashStore, each rank of `records` on a thread; the results by rank."""
    results = {}

    def rank_main(rank):
        try:
            results[rank] = agree(store, rank, size, records[rank], decide, 10)
        except Exception as error:  # noqa: BLE001 - the test looks at it
            results[rank] = error

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in records]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "the meeting hung"
    return results


def test_ranks_meet_through_one_key_each():
    """Rank 0 reads every rank's record in one read and publishes one answer; each other rank
    claims its place with one write and reads only that answer."""
    store = dist.HashStore()
    reads, writes = [], []

    class CountingStore(dist.Store):
        def set(self, key, value):
            writes.append(key)
            store.set(key, value)

        def add(self, key, amount):
            return store.add(key, amount)

        def multi_set(self, keys, values):
            writes.extend(keys)
            store.multi_set(keys, values)

        def wait(self, keys, timeout):
            store.wait(keys, timeout)

        def get(self, key):
            reads.append(key)
            return store.get(key)

        def compare_set(self, key, expected, desired):
            (reads if expected == desired else writes).append(key)
            return store.compare_set(key, expected, desired)

    seen = []

    def decide(records, details, epoch):
        seen.append(records)
        return {"answer": 42}

    counting = CountingStore()
    third = threading.Thread(target=lambda: seen.append(agree(counting, 3, 4, "r3", None, 10)))
    third.start()
    results = _meet_in_threads(store, {0: "r0", 1: "r1", 2: "r2"}, 4, decide)
    third.join(timeout=30)
    assert seen[0] == ["r0", "r1", "r2", "r3"], seen
    assert all(r["answer"] == 42 for r in [*results.values(), seen[1]]), (results, seen)
    assert len({r["epoch"] for r in [*results.values(), seen[1]]}) == 1
    assert len(reads) == 1 and reads[0].endswith("/result"), reads
    # Its claim, or, when it came before rank 0, a wait for it and then its claim.
    assert [w.rsplit("/", 1)[-1] for w in writes] == ["3"] and writes[0].endswith("/rank/3"), writes


def test_settings_that_differ_are_read_in_a_second_step_only_from_the_ranks_asked():
    """Rank 0 reads no rank's details unless it asks (their settings differ); then the ranks it
    asks send them, and every rank returns the verdict, the same everywhere."""
    def decide(records, details, epoch):
        return {"details": details([0, 2]) if len(set(records)) > 1 else None}

    same = _meet_in_threads(dist.HashStore(), {r: "{}" for r in range(3)}, 3, decide)
    assert all(result["details"] is None for result in same.values()), same

    store = dist.HashStore()
    results = {}

    def rank_main(rank):
        results[rank] = agree(store, rank, 3, "{}" if rank != 2 else "{...}", decide, 10, detail=f"d{rank}")

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert [results[r]["details"] for r in range(3)] == [["d0", "d2"]] * 3, results
    assert not store.check(["torus/epoch/1/detail/1"]), "rank 1 was not asked"


def test_a_rank_that_cannot_join_is_named_on_every_rank():
    failing = {0: json.dumps({}), 1: json.dumps({}), 2: FAILED + "TORUS_CHUNK_BYTES='x' is not a size"}
    results = _meet_in_threads(dist.HashStore(), failing, 3, lambda records, details, epoch: {"failed": failures_of(records)})
    assert results[2] is None  # it raises its own error at once
    for rank in (0, 1):
        assert describe_failures(results[rank]["failed"]) == \
            "rank 2 cannot create the group: TORUS_CHUNK_BYTES='x' is not a size", results
    # Rank 0 fails: it answers at once, without waiting for the others.
    alone = _meet_in_threads(dist.HashStore(), {0: FAILED + "no such interface", 1: "{}"}, 2)
    for rank in (0, 1):
        assert describe_failures(alone[rank]["failed"]) == "rank 0 cannot create the group: no such interface"


def test_a_rank_whose_place_is_taken_waits_for_the_next_rank_0():
    """A second process running as rank 1 finds rank 1's place taken: it never joins the group
    the first one joined, and its timeout says whose place was taken. A rank that comes after a
    group closed joins the next rank 0's group, under an epoch of its own."""
    store = dist.HashStore()
    nothing = lambda records, details, epoch: {}  # noqa: E731
    outcome: dict = {}

    def run(name, rank, timeout):
        outcome[name] = _agree_or_error(store, rank, 3, timeout, nothing)

    threads = [threading.Thread(target=run, args=("rank 0", 0, 20)), threading.Thread(target=run, args=("rank 1", 1, 20))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while not store.check(["torus/epoch/1/rank/1"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    run("second rank 1", 1, 1)
    run("rank 2", 2, 20)
    for thread in threads:
        thread.join(timeout=30)
    assert isinstance(outcome["second rank 1"], TimeoutError), outcome
    assert "another process holds rank 1's place" in str(outcome["second rank 1"]), outcome
    first = {outcome[name]["epoch"] for name in ("rank 0", "rank 1", "rank 2")}
    assert len(first) == 1, outcome

    late = threading.Thread(target=run, args=("late rank 1", 1, 20))
    late.start()
    time.sleep(0.2)
    threads = [threading.Thread(target=run, args=(f"next rank {r}", r, 20)) for r in (0, 2)]
    for thread in threads:
        thread.start()
    for thread in [late, *threads]:
        thread.join(timeout=30)
    second = {outcome[name]["epoch"] for name in ("late rank 1", "next rank 0", "next rank 2")}
    assert len(second) == 1 and second != first, outcome


def _agree_or_error(store, rank, size, timeout, decide=None):
    try:
        return agree(store, rank, size, "{}", decide, timeout)
    except TimeoutError as error:
        return error


def test_a_record_rank_0_cannot_read_fails_every_rank_at_once():
    """Records come from the network: one rank 0 cannot parse fails the group on every rank at
    once, naming the error, rather than leaving the others to their timeout."""
    results = _meet_in_threads(dist.HashStore(), {0: "{}", 1: "{", 2: "{}"}, 3,
                               lambda records, details, epoch: {"hosts": [json.loads(r) for r in records]})
    assert isinstance(results[0], json.JSONDecodeError), results
    for rank in (1, 2):
        assert describe_failures(results[rank]["failed"]).startswith(
            "rank 0 cannot create the group: JSONDecodeError"), results


def test_interface_address_of_loopback():
    assert local_address("lo") == "127.0.0.1"
    assert local_address("", environ={"MASTER_ADDR": "127.0.0.1"}) == "127.0.0.1"
    if socket.has_ipv6 and os.path.exists("/proc/net/if_inet6"):
        assert local_address("", environ={"MASTER_ADDR": "::1"}) == "::1"


def test_the_interface_address_is_its_first_ipv4_address_else_ipv6(monkeypatch):
    def entry(family, address):
        return SimpleNamespace(family=family, address=address, netmask=None, broadcast=None, ptp=None)

    interfaces = {
        "ib0": [entry(psutil.AF_LINK, "80:00:02:08"), entry(socket.AF_INET6, "fe80::1"),
                entry(socket.AF_INET, "10.1.2.3"), entry(socket.AF_INET, "10.9.9.9")],
        "tap0": [entry(psutil.AF_LINK, "02:00:00:00:00:01")],
        "eth6": [entry(socket.AF_INET6, "fd00::2"), entry(socket.AF_INET6, "fe80::fc00:ff:fe00:1%eth6")],
    }
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: interfaces)
    assert local_address("ib0") == "10.1.2.3"
    assert local_address("eth6") == "fd00::2"  # no IPv4 address: the first IPv6 one
    with pytest.raises(ConfigError, match="TORUS_SOCKET_IFNAME='tap0': the interface has no IPv4 or IPv6 address"):
        local_address("tap0")
    with pytest.raises(ConfigError, match="TORUS_SOCKET_IFNAME='eth9': the interface does not exist here"):
        local_address("eth9")


@pytest.mark.parametrize("record", ["{", "[]", json.dumps({"id": "h", "address": "10.0.0.1", "ifname": ""}),
                                    json.dumps({"id": "h", "address": "10.0.0.1", "ifname": "", "settings": "d",
                                                "tcp": 29500})])
def test_a_meeting_record_rank_0_cannot_read_is_named_by_rank(record):
    """Records come from the network: one that is not JSON, not an object, lacks a field or has
    one of the wrong type fails naming the rank it came from."""
    from torch_torus import _parse_record

    with pytest.raises(ValueError, match=r"rank 3's meeting record is not one a torus rank sends"):
        _parse_record(3, record)
    good = json.dumps({"id": "h", "address": "10.0.0.1", "ifname": "", "settings": "d", "tcp": "10.0.0.1:1"})
    assert _parse_record(3, good)["tcp"] == "10.0.0.1:1"
