"""The emulated network: a namespace per host on a bridge in a namespace of its own, each host's
link shaped both ways (see emulate.py); setting it up, taking it down, and finding what a killed
run left behind."""

from __future__ import annotations

import ipaddress
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

from .links import default_burst, format_rate

NAME_PREFIX = "torus-"
NAME_PATTERN = re.compile(r"^torus-(h\d+|br)-(\d+)$")
NETNS_ETC = Path("/etc/netns")


class ClusterError(RuntimeError):
    """The emulated cluster cannot be set up (not root, no ip/tc, a command failed)."""


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
