"""torch_torus.launch: torch's env:// variables from MPICH's and Open MPI's mpiexec, in one
process, with the environment and the MPI communicator played by stand-ins."""

from __future__ import annotations

import socket

import pytest

from torch_torus.launch import MpiLaunch, MpiLaunchError, init_env_from_mpi, mpi_launch_from_env

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


def test_rank_0_picks_loopback_and_a_free_port_on_one_host():
    environ = {**OPEN_MPI_RANK_1, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    host = socket.gethostname()
    init_env_from_mpi(FakeComm(0, 4, [host] * 4), environ)
    assert environ["MASTER_ADDR"] == "127.0.0.1"
    assert 0 < int(environ["MASTER_PORT"]) < 65536
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
