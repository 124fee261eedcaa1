"""A cluster on one machine: H hosts as network namespaces on a bridge, links shaped by tc tbf.

    python -m benchmarks.cluster --hosts 2 --nproc-per-host 4 --link 1gbit \\
        -- -m torch_torus.bench --backends 'torus:allreduce=ring;torus:allreduce=torus;gloo'

Each emulated host is a network namespace (torus-h<i>-<pid>) with loopback, one veth `eth0`
with the address <subnet>.<i+1> and its own host name node<i> (a UTS namespace per process,
and /etc/hosts naming every host through ip netns' /etc/netns/<ns>/hosts). The other ends of
the veths hang on a bridge `br0` in a namespace of its own (torus-br-<pid>), so nothing is
added to the machine's own network namespace. With --link RATE each link is shaped in both
directions: a tbf qdisc on the host's eth0 (what the host sends) and one on the bridge's end
(what it receives).

Then one command per host runs inside its namespace, started by a launcher:

  torchrun  torchrun --nnodes H --nproc-per-node P --node-rank i --master-addr <node0's address>
            --master-port PORT <your script and arguments>  (the default)
  srun      P processes per host with the variables Slurm's srun sets (SLURM_PROCID,
            SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_TASKS_PER_NODE,
            SLURM_JOB_NODELIST="node[0-1]", ...), no MASTER_ADDR: a stand-in for srun
  mpi       P processes per host with Open MPI's mpiexec variables (OMPI_COMM_WORLD_RANK, ...)
            and MASTER_ADDR/MASTER_PORT, as `mpiexec -x MASTER_ADDR -x MASTER_PORT` passes them
  mpiexec   a real mpiexec (MPICH's Hydra or Open MPI's, --mpiexec) on node0 starts P ranks per
            host; it reaches the other hosts through enter_host.py as its remote shell, and the
            ranks get MASTER_ADDR/MASTER_PORT: the bench's mpi contender across hosts (one
            command for every host: {node_rank}, {hostname} and {addr} are not replaced)
  none      your command once per host as it is

In every command {node_rank}, {nnodes}, {nproc}, {hostname}, {addr}, {master_addr},
{master_port}, {results} and {link_bits} (the shaped rate in bit/s, 0 if unshaped) are
replaced by their values for that host. The environment is passed through (less the launcher
variables of torchrun, Slurm and MPI); --env adds to it.
Each host's stdout and stderr go to <results>/node<i>.stdout and .stderr and are printed at
the end. The network is always taken down: on success, failure, exceptions, SIGINT, SIGTERM
and SIGHUP; `--cleanup` removes what a killed run left (namespaces of runs whose process is
gone). Needs root.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .enter_host import NAMESPACES_VARIABLE

NAME_PREFIX = "torus-"
NAME_PATTERN = re.compile(r"^torus-(h\d+|br)-(\d+)$")
NETNS_ETC = Path("/etc/netns")
REPO_ROOT = Path(__file__).resolve().parents[2]
LINKTEST = Path(__file__).resolve().with_name("linktest.py")
ENTER_HOST = Path(__file__).resolve().with_name("enter_host.py")

# Launcher variables a host's processes must not inherit from the caller's environment: they
# would describe the caller's job, not the emulated one.
INHERITED_LAUNCH_VARIABLES = re.compile(
    r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_RANK|"
    r"ROLE_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_\w+|SLURM_\w+|SLURMD_\w+|OMPI_\w+|"
    r"PMI_\w+|PMIX_\w+|MPI_LOCALRANKID|MPI_LOCALNRANKS)$")

RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
              "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


class ClusterError(RuntimeError):
    """The emulated cluster cannot be set up (not root, no ip/tc, a command failed)."""


class Interrupted(BaseException):
    """A signal arrived; raised from the handler so that finally blocks tear down."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def parse_rate(text: str) -> float | None:
    """tc's rate syntax ('1gbit', '500mbit', '125mbps' = bytes) -> bits per second; 'none' or
    '0' -> None (links not shaped)."""
    text = text.strip().lower()
    if text in ("none", "0", ""):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]+)", text)
    if not match or match.group(2) not in RATE_UNITS:
        raise argparse.ArgumentTypeError(
            f"not a rate: {text!r} (e.g. 1gbit, 500mbit, 100mbps; units {', '.join(RATE_UNITS)})")
    return float(match.group(1)) * RATE_UNITS[match.group(2)]


def default_burst(rate_bits: float) -> int:
    """tbf's bucket in bytes: 1 ms worth of the rate, at least 128 KiB. The bucket must hold the
    largest packet the veth hands down (GSO packets up to 64 KiB); a bucket much smaller than
    the rate times the kernel's timer granularity leaves the link below its rate."""
    return max(128 << 10, int(rate_bits / 8 / 1000))


def format_rate(rate_bits: float | None) -> str:
    if rate_bits is None:
        return "unshaped"
    for unit, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate_bits >= factor:
            return f"{rate_bits / factor:g}{unit}"
    return f"{rate_bits:g}bit"


def require_root_tools() -> None:
    """Raise ClusterError saying what is missing: root, ip (with netns), tc, unshare."""
    if os.geteuid() != 0:
        raise ClusterError("the cluster emulator needs root (it creates network namespaces, veths, "
                           "a bridge and tc qdiscs): run it as root, e.g. with sudo -E")
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            raise ClusterError(f"the cluster emulator needs `{tool}` on PATH "
                               "(iproute2 for ip and tc, util-linux for unshare)")
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise ClusterError(f"`ip netns list` failed: {probe.stderr.strip()}")


def run_ip(*argv: str) -> str:
    result = subprocess.run(list(argv), capture_output=True, text=True)
    if result.returncode != 0:
        raise ClusterError(f"`{shlex.join(argv)}` failed ({result.returncode}): "
                           f"{(result.stderr or result.stdout).strip()}")
    return result.stdout


@dataclass
class Host:
    index: int
    netns: str
    hostname: str
    address: str
    outer: str  # the veth's end on the bridge, in the bridge's namespace


@dataclass
class Cluster:
    """The emulated network. `up()` builds it, `down()` removes it (idempotent, never raises)."""

    hosts: int
    rate_bits: float | None = None
    subnet: str = "10.213.0.0/24"
    burst: int | None = None
    latency: str = "20ms"
    mtu: int = 1500
    run_id: int = field(default_factory=os.getpid)
    hostname_prefix: str = "node"
    members: list[Host] = field(default_factory=list)
    created: list[str] = field(default_factory=list)  # namespaces, in creation order

    def __post_init__(self):
        network = ipaddress.ip_network(self.subnet)
        if self.hosts < 1 or self.hosts > network.num_addresses - 2:
            raise ClusterError(f"{self.hosts} hosts do not fit in {self.subnet}")
        self.prefixlen = network.prefixlen
        addresses = list(network.hosts())
        self.bridge_netns = f"{NAME_PREFIX}br-{self.run_id}"
        self.members = [Host(i, f"{NAME_PREFIX}h{i}-{self.run_id}", f"{self.hostname_prefix}{i}",
                             str(addresses[i]), f"v{i}") for i in range(self.hosts)]

    @property
    def master(self) -> Host:
        return self.members[0]

    @property
    def nodelist(self) -> str:
        """The hosts in Slurm's compressed form: node[0-3]."""
        if self.hosts == 1:
            return self.master.hostname
        return f"{self.hostname_prefix}[0-{self.hosts - 1}]"

    def tbf(self) -> list[str]:
        burst = self.burst or default_burst(self.rate_bits)
        return ["tbf", "rate", f"{int(self.rate_bits)}bit", "burst", str(burst),
                "latency", self.latency]

    def up(self) -> None:
        require_root_tools()
        self._add_netns(self.bridge_netns)
        br = ["ip", "-n", self.bridge_netns]
        run_ip(*br, "link", "set", "lo", "up")
        run_ip(*br, "link", "add", "br0", "type", "bridge", "forward_delay", "0")
        run_ip(*br, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n::1 localhost ip6-localhost\n" + "".join(
            f"{h.address} {h.hostname}\n" for h in self.members)
        for h in self.members:
            self._add_netns(h.netns)
            directory = NETNS_ETC / h.netns
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "hosts").write_text(hosts_file)
            inside = ["ip", "-n", h.netns]
            run_ip(*inside, "link", "set", "lo", "up")
            run_ip(*br, "link", "add", h.outer, "mtu", str(self.mtu), "type", "veth",
                   "peer", "name", "eth0", "mtu", str(self.mtu), "netns", h.netns)
            run_ip(*br, "link", "set", h.outer, "master", "br0", "up")
            run_ip(*inside, "addr", "add", f"{h.address}/{self.prefixlen}", "dev", "eth0")
            run_ip(*inside, "link", "set", "eth0", "up")
            if self.rate_bits is not None:
                # Egress of each end: eth0 shapes what the host sends, the bridge's end what
                # it receives.
                run_ip("ip", "netns", "exec", h.netns, "tc", "qdisc", "replace", "dev", "eth0",
                       "root", *self.tbf())
                run_ip("ip", "netns", "exec", self.bridge_netns, "tc", "qdisc", "replace", "dev",
                       h.outer, "root", *self.tbf())

    def _add_netns(self, name: str) -> None:
        run_ip("ip", "netns", "add", name)
        self.created.append(name)

    def down(self) -> list[str]:
        """Kill what still runs in the namespaces, delete them (their veths and the bridge go
        with them) and their /etc/netns entries. Returns the problems met, if any."""
        problems = []
        for name in reversed(self.created):
            problems += remove_netns(name)
        self.created.clear()
        return problems

    def describe(self) -> str:
        shaping = "unshaped links"
        if self.rate_bits is not None:
            shaping = (f"links shaped to {format_rate(self.rate_bits)} each way (tbf burst "
                       f"{self.burst or default_burst(self.rate_bits)} B, latency {self.latency})")
        hosts = ", ".join(f"{h.hostname}={h.address} ({h.netns})" for h in self.members)
        return f"{self.hosts} hosts on bridge br0 in {self.bridge_netns}, {shaping}: {hosts}"

    def wrap(self, host: Host, argv: list[str]) -> list[str]:
        """argv run inside the host: its network namespace, /etc/hosts, and its host name."""
        return ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', host.hostname, *argv]


def netns_pids(name: str) -> list[int]:
    result = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    return [int(pid) for pid in result.stdout.split() if pid.isdigit()]


def remove_netns(name: str) -> list[str]:
    """Kill the processes in namespace `name` (all were started in it by an emulator run),
    delete it and its /etc/netns entry. Returns problems, never raises."""
    problems = []
    for signum, pause in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 1.0)):
        pids = netns_pids(name)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + pause
        while time.monotonic() < deadline and netns_pids(name):
            time.sleep(0.05)
    result = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
    if result.returncode != 0 and "No such file" not in result.stderr:
        problems.append(f"ip netns del {name}: {result.stderr.strip()}")
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
    try:
        NETNS_ETC.rmdir()  # only when empty: other users' entries stay
    except OSError:
        pass
    return problems


def leftovers(pid: int | None = None, include_live: bool = False) -> list[str]:
    """Namespaces left by emulator runs: of run `pid`, or of every run whose process is gone
    (or of every run, with include_live)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = []
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = NAME_PATTERN.match(name)
        if not match:
            continue
        owner = int(match.group(2))
        if pid is not None:
            if owner == pid:
                names.append(name)
        elif include_live or not Path(f"/proc/{owner}").exists():
            names.append(name)
    return names


def cleanup(pid: int | None = None, include_live: bool = False) -> list[str]:
    """Remove leftovers (see `leftovers`); returns the names removed."""
    names = leftovers(pid, include_live)
    # Hosts first, the bridge last (its veth ends go with either side).
    names.sort(key=lambda name: "br-" in name)
    for name in names:
        for problem in remove_netns(name):
            print(f"cluster cleanup: {problem}", file=sys.stderr)
    return names


# --------------------------------------------------------------------------------------------
# Launchers: the processes each host runs.


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


# --------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  python -m benchmarks.cluster --hosts 2 --nproc-per-host 4 --link 1gbit -- \\\n"
               "      -m torch_torus.bench -b 1M -e 64M --backends 'torus:allreduce=torus;gloo'\n"
               "  python -m benchmarks.cluster --hosts 2 --nproc-per-host 2 --launcher srun -- \\\n"
               "      python examples/ddp_resnet50.py --image-size 32 --steps 3\n"
               "  python -m benchmarks.cluster --hosts 2 --link 1gbit --linktest 5\n"
               "  python -m benchmarks.cluster --cleanup")
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts (default: %(default)s)")
    parser.add_argument("--nproc-per-host", "--nproc-per-node", dest="nproc", type=int, default=1,
                        help="ranks per host (default: %(default)s)")
    parser.add_argument("--link", type=parse_rate, default=None, metavar="RATE",
                        help="shape every host's link to RATE in each direction, tc syntax "
                             "(1gbit, 500mbit); default: unshaped")
    parser.add_argument("--burst", type=int, default=None, metavar="BYTES",
                        help="tbf bucket (default: 1 ms of the rate, at least 128 KiB)")
    parser.add_argument("--latency", default="20ms",
                        help="tbf latency: the longest a packet may queue (default: %(default)s)")
    parser.add_argument("--mtu", type=int, default=1500, help="veth MTU (default: %(default)s)")
    parser.add_argument("--subnet", default="10.213.0.0/24",
                        help="host addresses come from this private range, node<i> = host i+1 "
                             "(default: %(default)s)")
    parser.add_argument("--launcher", choices=["torchrun", "srun", "mpi", "mpiexec", "none"],
                        default="torchrun", help="how each host starts its ranks (default: "
                                                 "%(default)s; see above)")
    parser.add_argument("--mpiexec", default=default_mpiexec(), metavar="PATH",
                        help="the mpiexec of --launcher mpiexec (default: beside this Python, "
                             "else on PATH: %(default)s)")
    parser.add_argument("--master-port", type=int, default=29500,
                        help="rendezvous port on node0 (default: %(default)s)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="torchrun's --max-restarts on each host: how often a host's agent "
                             "restarts its ranks after one fails (default: %(default)s)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="set a variable in every host's processes; repeatable")
    parser.add_argument("--results", type=Path, default=None,
                        help="folder for each host's stdout/stderr and cluster.json "
                             "(default: bench-out/cluster/<time>-<pid>)")
    parser.add_argument("--timeout", type=float, default=3600,
                        help="stop every host after this many seconds (exit 124; default: "
                             "%(default)s)")
    parser.add_argument("--grace", type=float, default=30,
                        help="once a host's command failed, seconds the others get before they "
                             "are stopped (default: %(default)s)")
    parser.add_argument("--linktest", type=float, default=0, metavar="SECONDS",
                        help="first measure TCP throughput node1->node0, node0->node1 and both "
                             "at once for SECONDS each (needs 2 hosts)")
    parser.add_argument("--quiet", action="store_true",
                        help="do not print the hosts' output at the end (it stays in --results)")
    parser.add_argument("--cleanup", action="store_true",
                        help="remove namespaces left by runs that are gone, and exit")
    parser.add_argument("--cleanup-pid", type=int, default=None, metavar="PID",
                        help="with --cleanup: remove the namespaces of run PID, live or not")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="after --: the script and arguments (torchrun launcher) or the "
                             "command (other launchers)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.cleanup:
        try:
            require_root_tools()
        except ClusterError as error:
            print(f"cluster: {error}", file=sys.stderr)
            return 2
        removed = cleanup(args.cleanup_pid)
        print(f"cluster cleanup: removed {len(removed)} namespace(s)"
              + (f": {', '.join(removed)}" if removed else ""))
        return 0
    if not command and not args.linktest:
        parser.error("nothing to run: give a command after --, or --linktest")
    if args.hosts < 1 or args.nproc < 1:
        parser.error("--hosts and --nproc-per-host must be at least 1")

    results = args.results or REPO_ROOT / "bench-out" / "cluster" / (
        time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")
    handlers = {}

    def interrupt(signum, frame):
        raise Interrupted(signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        handlers[signum] = signal.signal(signum, interrupt)
    cluster = None
    status = 1
    try:
        cluster = Cluster(args.hosts, args.link, args.subnet, args.burst, args.latency, args.mtu)
        cluster.up()
        print(f"cluster: {cluster.describe()}", flush=True)
        summary = {"hosts": args.hosts, "nproc_per_host": args.nproc,
                   "link_bits_per_s": args.link, "tbf": cluster.tbf() if args.link else None,
                   "launcher": args.launcher, "command": command,
                   "addresses": {h.hostname: h.address for h in cluster.members}}
        if args.linktest:
            summary["linktest"] = linktest(cluster, args.linktest)
            print_linktest(summary["linktest"])
        status = 0
        if command:
            env = clean_env(args.env)
            processes = plan(cluster, args.launcher, args.nproc, command, args.master_port, env,
                             results, args.max_restarts, args.mpiexec)
            for p in processes[:: max(1, len(processes) // args.hosts)]:
                print(f"cluster: {p.label}: {shlex.join(p.argv)}", flush=True)
            start = time.monotonic()
            codes, timed_out = run_processes(cluster, processes, results, args.timeout,
                                             args.grace)
            summary["seconds"] = time.monotonic() - start
            summary["exit_codes"] = {p.label: code for p, code in zip(processes, codes)}
            if timed_out:
                status = 124
            elif any(code != 0 for code in codes):
                status = next((code for code in codes if code not in (0, None)), 1)
                status = status if 0 < status < 256 else 1
            if not args.quiet:
                show_outputs(cluster, results)
            print(f"cluster: exit codes {summary['exit_codes']} after {summary['seconds']:.1f} s; "
                  f"output in {results}", flush=True)
        results.mkdir(parents=True, exist_ok=True)
        (results / "cluster.json").write_text(json.dumps(summary, indent=1) + "\n")
    except ClusterError as error:
        print(f"cluster: {error}", file=sys.stderr, flush=True)
        status = 2
    except Interrupted as interruption:
        print(f"cluster: {interruption}; taking the cluster down", file=sys.stderr, flush=True)
        status = 128 + interruption.signum
    finally:
        for signum in handlers:
            signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C must not stop the teardown
        if cluster is not None:
            for problem in cluster.down():
                print(f"cluster teardown: {problem}", file=sys.stderr, flush=True)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return status


def show_outputs(cluster: Cluster, results: Path) -> None:
    for h in cluster.members:
        for stream in ("stdout", "stderr"):
            path = results / f"{h.hostname}.{stream}"
            text = path.read_text(errors="replace") if path.exists() else ""
            if text.strip():
                print(f"===== {h.hostname} ({h.address}) {stream} =====\n{text.rstrip()}",
                      flush=True)


if __name__ == "__main__":
    sys.exit(main())
