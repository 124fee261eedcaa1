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

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from .launchers import (REPO_ROOT, clean_env, default_mpiexec, linktest, plan, print_linktest,
                        run_processes)
from .links import parse_rate
from .namespaces import Cluster, ClusterError, cleanup, require_root_tools


class Interrupted(BaseException):
    """A signal arrived; raised from the handler so that finally blocks tear down."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


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
