"""Launchers: the processes each emulated host runs (torchrun, srun's and mpiexec's stand-ins, a
real mpiexec, the command as it is), started inside the hosts, bounded and stopped; and the link
test's senders and receivers."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .enter_host import NAMESPACES_VARIABLE
from .namespaces import Cluster, ClusterError, Host

REPO_ROOT = Path(__file__).resolve().parents[2]
LINKTEST = Path(__file__).resolve().with_name("linktest.py")
ENTER_HOST = Path(__file__).resolve().with_name("enter_host.py")

# Launcher variables a host's processes must not inherit from the caller's environment: they
# would describe the caller's job, not the emulated one.
INHERITED_LAUNCH_VARIABLES = re.compile(
    r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_RANK|"
    r"ROLE_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_\w+|SLURM_\w+|SLURMD_\w+|OMPI_\w+|"
    r"PMI_\w+|PMIX_\w+|MPI_LOCALRANKID|MPI_LOCALNRANKS)$")


@dataclass
class Process:
    host: Host
    argv: list[str]
    env: dict[str, str]
    label: str


def substitute(argv: list[str], values: dict[str, str]) -> list[str]:
    out = []
    for word in argv:
        for key, value in values.items():
            word = word.replace("{" + key + "}", value)
        out.append(word)
    return out


def tasks_per_node(counts: list[int]) -> str:
    """Slurm's SLURM_TASKS_PER_NODE: [2, 2, 1] -> '2(x2),1'."""
    groups: list[list[int]] = []
    for count in counts:
        if groups and groups[-1][0] == count:
            groups[-1][1] += 1
        else:
            groups.append([count, 1])
    return ",".join(f"{c}(x{n})" if n > 1 else str(c) for c, n in groups)


def default_mpiexec() -> str | None:
    """The mpiexec beside this Python (where pip puts the MPI from PyPI), else one on PATH."""
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if os.access(beside, os.X_OK) else shutil.which("mpiexec")


def mpiexec_argv(cluster: Cluster, nproc: int, mpiexec: str) -> list[str]:
    """mpiexec starting nproc ranks on every host, the remote ones through enter_host.py."""
    try:
        version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ClusterError(f"--mpiexec {mpiexec}: {error}") from None
    agent = str(ENTER_HOST)
    world = str(cluster.hosts * nproc)
    if "Open MPI" in version.stdout + version.stderr:
        hosts = ",".join(f"{h.hostname}:{nproc}" for h in cluster.members)
        return [mpiexec, "--host", hosts, "-n", world, "--bind-to", "none",
                "--mca", "plm_ssh_agent", agent]
    hosts = ",".join(h.hostname for h in cluster.members)
    return [mpiexec, "-hosts", hosts, "-ppn", str(nproc), "-n", world,
            "-launcher", "ssh", "-launcher-exec", agent]


def plan(cluster: Cluster, launcher: str, nproc: int, argv: list[str], master_port: int,
         base_env: dict[str, str], results: Path, max_restarts: int = 0,
         mpiexec: str | None = None) -> list[Process]:
    """The processes to start, one list entry per process, in host order. `max_restarts`:
    torchrun's, on each host; `mpiexec`: the mpiexec launcher's."""
    processes = []
    # The placeholders every host shares; each host's own are added below.
    shared = {"nnodes": str(cluster.hosts), "nproc": str(nproc), "master_addr": cluster.master.address,
              "master_port": str(master_port), "results": str(results),
              "link_bits": str(int(cluster.rate_bits or 0))}
    if launcher == "mpiexec":
        if mpiexec is None:
            raise ClusterError("--launcher mpiexec: no mpiexec beside this Python or on PATH "
                               "(--mpiexec PATH)")
        env = dict(base_env, MASTER_ADDR=cluster.master.address, MASTER_PORT=str(master_port))
        env[NAMESPACES_VARIABLE] = ",".join(f"{h.hostname}={h.netns}" for h in cluster.members)
        if nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        command = substitute(argv, shared)
        return [Process(cluster.master, mpiexec_argv(cluster, nproc, mpiexec) + command, env,
                        cluster.master.hostname)]
    world = cluster.hosts * nproc
    for h in cluster.members:
        command = substitute(argv, dict(shared, node_rank=str(h.index), hostname=h.hostname,
                                        addr=h.address))
        if launcher == "torchrun":
            full = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(cluster.hosts),
                    "--nproc-per-node", str(nproc), "--node-rank", str(h.index),
                    "--master-addr", cluster.master.address, "--master-port", str(master_port),
                    "--max-restarts", str(max_restarts), *command]
            processes.append(Process(h, full, dict(base_env), h.hostname))
        elif launcher == "none":
            env = dict(base_env, MASTER_ADDR=cluster.master.address, MASTER_PORT=str(master_port))
            processes.append(Process(h, command, env, h.hostname))
        else:
            for local in range(nproc):
                rank = h.index * nproc + local
                if launcher == "srun":
                    env = dict(base_env, SLURM_PROCID=str(rank), SLURM_NTASKS=str(world),
                               SLURM_STEP_NUM_TASKS=str(world), SLURM_LOCALID=str(local),
                               SLURM_NODEID=str(h.index), SLURM_NNODES=str(cluster.hosts),
                               SLURM_STEP_NUM_NODES=str(cluster.hosts),
                               SLURM_TASKS_PER_NODE=tasks_per_node([nproc] * cluster.hosts),
                               SLURM_STEP_TASKS_PER_NODE=tasks_per_node([nproc] * cluster.hosts),
                               SLURM_JOB_NODELIST=cluster.nodelist,
                               SLURM_STEP_NODELIST=cluster.nodelist,
                               SLURM_JOB_ID=str(cluster.run_id), SLURM_STEP_ID="0",
                               SLURMD_NODENAME=h.hostname)
                elif launcher == "mpi":
                    env = dict(base_env, OMPI_COMM_WORLD_RANK=str(rank),
                               OMPI_COMM_WORLD_SIZE=str(world),
                               OMPI_COMM_WORLD_LOCAL_RANK=str(local),
                               OMPI_COMM_WORLD_LOCAL_SIZE=str(nproc),
                               OMPI_COMM_WORLD_NODE_RANK=str(h.index),
                               MASTER_ADDR=cluster.master.address, MASTER_PORT=str(master_port))
                else:
                    raise ValueError(f"unknown launcher {launcher!r}")
                # Torch's default of one OpenMP thread per rank when a host runs several, as
                # torchrun sets it.
                if nproc > 1:
                    env.setdefault("OMP_NUM_THREADS", "1")
                processes.append(Process(h, command, env, f"{h.hostname}.{local}"))
    return processes


def clean_env(extra: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not INHERITED_LAUNCH_VARIABLES.match(k)}
    # The repository on the path, so `-m torch_torus.bench` and `-m benchmarks...` import
    # in the hosts as they do here (cwd is kept as well).
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_ROOT) not in paths:
        paths.append(str(REPO_ROOT))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    for item in extra:
        key, separator, value = item.partition("=")
        if not separator:
            raise ClusterError(f"--env {item!r}: expected KEY=VALUE")
        env[key] = value
    return env


def run_processes(cluster: Cluster, processes: list[Process], results: Path, timeout: float,
                  grace: float) -> tuple[list[int | None], bool]:
    """Start every process, wait for all; once one fails the others get `grace` seconds, and
    after `timeout` seconds all are stopped. Returns the exit codes (None: stopped by us) and
    whether the time limit was reached."""
    results.mkdir(parents=True, exist_ok=True)
    running: list[subprocess.Popen] = []
    files = {}
    try:
        for p in processes:
            for stream in ("stdout", "stderr"):
                path = results / f"{p.host.hostname}.{stream}"
                if path not in files:
                    files[path] = open(path, "ab")
            running.append(subprocess.Popen(
                cluster.wrap(p.host, p.argv), env=p.env, start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=files[results / f"{p.host.hostname}.stdout"],
                stderr=files[results / f"{p.host.hostname}.stderr"]))
        codes: list[int | None] = [None] * len(running)
        deadline = time.monotonic() + timeout
        failed_at = None
        timed_out = False
        while any(code is None for code in codes):
            for i, proc in enumerate(running):
                if codes[i] is None and proc.poll() is not None:
                    codes[i] = proc.returncode
                    if proc.returncode != 0 and failed_at is None:
                        failed_at = time.monotonic()
                        print(f"cluster: {processes[i].label} exited with {proc.returncode}; "
                              f"the others get {grace:g} s", file=sys.stderr, flush=True)
            now = time.monotonic()
            if now > deadline or (failed_at is not None and now > failed_at + grace):
                if now > deadline:
                    timed_out = True
                    print(f"cluster: time limit of {timeout:g} s reached; stopping every host",
                          file=sys.stderr, flush=True)
                break
            time.sleep(0.05)
        return codes, timed_out
    finally:
        stop(running)
        for file in files.values():
            file.close()


def stop(running: list[subprocess.Popen]) -> None:
    """SIGTERM to each process group we started that is still there, SIGKILL after 3 s."""
    alive = [p for p in running if p.poll() is None]
    for signum, pause in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
        for proc in alive:
            try:
                os.killpg(proc.pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + pause
        while time.monotonic() < deadline and any(p.poll() is None for p in alive):
            time.sleep(0.05)
        alive = [p for p in alive if p.poll() is None]
        if not alive:
            break


# --------------------------------------------------------------------------------------------
# Link test


def linktest(cluster: Cluster, seconds: float, port: int = 5201) -> dict:
    """TCP throughput node1 -> node0, node0 -> node1, then both at once; Mbit/s per direction."""
    if cluster.hosts < 2:
        raise ClusterError("--linktest needs at least 2 hosts")
    a, b = cluster.members[0], cluster.members[1]
    python = sys.executable

    def transfer(pairs: list[tuple[Host, Host]]) -> list[dict]:
        servers, clients = [], []
        try:
            for k, (sender, receiver) in enumerate(pairs):
                servers.append(subprocess.Popen(
                    cluster.wrap(receiver, [python, str(LINKTEST), "serve", str(port + k)]),
                    stdout=subprocess.PIPE, text=True, start_new_session=True))
                servers[-1].stdout.readline()  # "listening"
            for k, (sender, receiver) in enumerate(pairs):
                clients.append(subprocess.Popen(
                    cluster.wrap(sender, [python, str(LINKTEST), "send", receiver.address,
                                          str(port + k), str(seconds)]),
                    stdout=subprocess.PIPE, text=True, start_new_session=True))
            out = []
            for (sender, receiver), server in zip(pairs, servers):
                line = server.communicate(timeout=seconds + 60)[0].strip().splitlines()[-1]
                result = json.loads(line)
                result["direction"] = f"{sender.hostname}->{receiver.hostname}"
                out.append(result)
            for client in clients:
                client.communicate(timeout=30)
            return out
        finally:
            stop(servers + clients)

    results = {"rate_mbit": cluster.rate_bits / 1e6 if cluster.rate_bits else None,
               "one_way": transfer([(b, a)]) + transfer([(a, b)]),
               "both_ways": transfer([(b, a), (a, b)])}
    return results


def print_linktest(results: dict) -> None:
    rate = results["rate_mbit"]
    for kind in ("one_way", "both_ways"):
        for r in results[kind]:
            share = f" = {r['mbit_per_s'] / rate:.3f} of {rate:g} Mbit/s" if rate else ""
            print(f"linktest {kind:<9} {r['direction']:<13} {r['mbit_per_s']:9.1f} Mbit/s"
                  f"{share} ({r['bytes'] / 2**20:.0f} MiB in {r['seconds']:.2f} s)", flush=True)
