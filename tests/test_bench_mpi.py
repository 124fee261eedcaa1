"""The bench with MPI as a contender: under mpiexec for real (2 ranks, tiny sizes, --check), and
its refusal to run the mpi contender without mpiexec.

The mpiexec run needs the optional dependency `pip install -e '.[mpi]'` (mpi4py and an MPI from
PyPI); without it the test is skipped, saying so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from torch_torus.bench import cli

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_BOUND_S = 180  # start-up of 2 ranks with torch, 3 contenders, 3 sizes; a few seconds when idle


def find_mpiexec() -> str | None:
    """The mpiexec next to this Python (where pip puts the MPI from PyPI), else one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")


def mpiexec_command(mpiexec: str) -> list[str]:
    """mpiexec with what Open MPI needs to start 2 ranks on any machine: oversubscription
    allowed (a 1-core CI runner) and root allowed (containers); MPICH's Hydra needs neither."""
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=60)
    if "Open MPI" in version.stdout + version.stderr:
        return [mpiexec, "--oversubscribe", "--bind-to", "none", "-n", "2"]
    return [mpiexec, "-n", "2"]


def run_bounded(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run mpiexec in its own session, so that on timeout the ranks die with it."""
    process = subprocess.Popen(command, env=env, cwd=REPOSITORY, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=RUN_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{' '.join(command)} did not finish within {RUN_BOUND_S} s:\n{output}")
    return subprocess.CompletedProcess(command, process.returncode, output)


def test_bench_with_mpi_contender_under_mpiexec(tmp_path):
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install -e '.[mpi]')")
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec beside this Python or on PATH (pip install -e '.[mpi]')")
    json_path = tmp_path / "bench.json"
    arguments = ["--backends", "torus;gloo;mpi", "-b", "1K", "-e", "16K", "-f", "4", "--iters",
                 "2", "--warmup", "1", "--check", "--json", str(json_path)]
    plotting = importlib.util.find_spec("matplotlib") is not None
    if plotting:
        arguments += ["--plot", str(tmp_path / "bench.png")]
    python_path = os.pathsep.join(filter(None, [REPOSITORY, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1",
           # Open MPI refuses root without both; MPICH ignores them.
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # as if started from a shell, not from within torchrun
    result = run_bounded(mpiexec_command(mpiexec) + [sys.executable, "-m", "torch_torus.bench"]
                         + arguments, env)

    assert result.returncode == 0, result.stdout
    assert "# 2 ranks on 1 host" in result.stdout, result.stdout
    assert "# Out of bounds values : 0 OK" in result.stdout, result.stdout
    document = json.loads(json_path.read_text())
    assert [contender["label"] for contender in document["contenders"]] == ["torus", "gloo", "mpi"]
    assert document["contenders"][2]["library"], document["contenders"]
    mpi_rows = [row for row in document["rows"] if row["contender"] == "mpi"]
    assert [row["size_bytes"] for row in mpi_rows] == [1024, 4096, 16384]
    assert all(row["wrong"] == 0 and row["busbw_gbps"] > 0 for row in mpi_rows), mpi_rows
    if plotting:
        assert (tmp_path / "bench.png").stat().st_size > 0


@pytest.mark.parametrize("launcher_env", [{}, {"RANK": "0", "WORLD_SIZE": "1"}],
                         ids=["no launcher", "torchrun"])
def test_mpi_contender_without_mpiexec_says_how_to_launch(monkeypatch, launcher_env):
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in launcher_env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit, match="must be started by mpiexec .*\n  mpiexec -n 4 python -m "
                                         "torch_torus.bench"):
        cli.main(["--backends", "gloo;mpi"])
