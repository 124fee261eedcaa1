"""Bytes each host sends and receives over its link per allreduce, and the link's utilization,
for several allreduce algorithms, on a cluster emulated by benchmarks.cluster:

    python -m benchmarks.cluster --hosts 2 --nproc-per-host 4 --link 1gbit -- \\
        benchmarks/cluster/link_utilization.py --size 64M --link-bits {link_bits}

Local rank 0 of every host reads its link's counters (/sys/class/net/eth0/statistics/tx_bytes
and rx_bytes, in the host's network namespace) before and after --iters calls of each
contender; every rank times its calls; the table gives, per contender and host, the mean time
per call (slowest rank), the bytes per call over the link each way as a multiple of the
message size S (the veth's counters; TCP hands it segments of up to 64 KiB with one set of
headers each, so this is within a fraction of a percent of the payload), and utilization = bytes sent / time / shaped rate. Traffic between ranks of one host does not
cross eth0 (it goes through the host's loopback), so the counters see only inter-host traffic.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

import torch_torus
from torch_torus.bench.sizes import parse_size

COUNTERS = Path("/sys/class/net/eth0/statistics")


def counters() -> tuple[int, int]:
    return (int((COUNTERS / "tx_bytes").read_text()), int((COUNTERS / "rx_bytes").read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("64M"))
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--contenders", default="ring,torus,rabenseifner,recursive_doubling,direct,gloo",
                        help="torus allreduce algorithms, and gloo (default: %(default)s)")
    parser.add_argument("--link-bits", type=float, default=0,
                        help="the shaped rate in bit/s, for the utilization (0: not shaped)")
    parser.add_argument("--json", help="write the table's values to this file (rank 0)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # bootstrap: barriers and gathering, as the bench does
    rank, size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    groups = {}
    for name in args.contenders.split(","):
        if name == "gloo":
            groups[name] = dist.new_group(backend="gloo")
        else:
            groups[name] = dist.new_group(backend="torus",
                                          pg_options=torch_torus.Options(allreduce=name))
    tensor = torch.ones(args.size // 4, dtype=torch.float32)
    rows = []
    for name, group in groups.items():
        for _ in range(args.warmup):
            dist.all_reduce(tensor, group=group)
        dist.barrier()
        before = counters() if local_rank == 0 else (0, 0)
        start = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(tensor, group=group)
        elapsed = time.perf_counter() - start
        dist.barrier()
        after = counters() if local_rank == 0 else (0, 0)
        gathered = [None] * size
        dist.all_gather_object(gathered, {"rank": rank, "local_rank": local_rank,
                                          "host": socket.gethostname(), "seconds": elapsed,
                                          "tx": after[0] - before[0], "rx": after[1] - before[1]})
        per_call = max(g["seconds"] for g in gathered) / args.iters
        algorithm = (torch_torus.algorithm_for("allreduce", args.size, group)
                     if name != "gloo" else "gloo")
        for g in gathered:
            if g["local_rank"] != 0:
                continue
            tx, rx = g["tx"] / args.iters, g["rx"] / args.iters
            rows.append({"contender": name, "algorithm": algorithm, "host": g["host"],
                         "seconds_per_call": per_call, "tx_bytes_per_call": tx,
                         "rx_bytes_per_call": rx, "tx_over_size": tx / args.size,
                         "rx_over_size": rx / args.size,
                         "utilization_tx": tx / per_call / (args.link_bits / 8)
                         if args.link_bits else None,
                         "utilization_rx": rx / per_call / (args.link_bits / 8)
                         if args.link_bits else None})
    if rank == 0:
        hosts = len({row["host"] for row in rows})
        link = f"links {args.link_bits / 1e6:g} Mbit/s each way" if args.link_bits else "unshaped"
        print(f"# allreduce of {args.size} bytes (S), {size} ranks on {hosts} hosts, "
              f"{args.iters} calls after {args.warmup} warmup; {link}")
        print(f"# {'contender':<20} {'algorithm':<19} {'host':<7} {'ms/call':>9} {'sent/S':>7} "
              f"{'recv/S':>7} {'util sent':>9} {'util recv':>9}")
        for row in rows:
            util = (f"{row['utilization_tx']:9.3f} {row['utilization_rx']:9.3f}"
                    if args.link_bits else f"{'-':>9} {'-':>9}")
            print(f"  {row['contender']:<20} {row['algorithm']:<19} {row['host']:<7} "
                  f"{row['seconds_per_call'] * 1e3:9.1f} {row['tx_over_size']:7.3f} "
                  f"{row['rx_over_size']:7.3f} {util}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"size": args.size, "world_size": size, "iters": args.iters,
                 "link_bits_per_s": args.link_bits or None, "rows": rows}, indent=1) + "\n")
            print(f"# wrote {args.json}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
