"""Run by test_cluster.py on every rank of an emulated cluster (torchrun per host, one network
namespace per host): allreduce with ring and torus over TCP between hosts, checked against the
one-process reference. Prints one line per rank, "CLUSTER-CASE rank R ok ..." or
"CLUSTER-CASE rank R FAIL ...", and exits 1 on any problem."""

from __future__ import annotations

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch_torus  # noqa: E402
from reference import check_reduction, gen_all  # noqa: E402

CASES = [("float32", "SUM", (0,)), ("float32", "SUM", (7,)), ("float32", "SUM", (4099,)),
         ("float32", "SUM", (300_001,)), ("int64", "SUM", (1027,)), ("float64", "MAX", (513,)),
         ("bfloat16", "SUM", (2048,))]


def main() -> int:
    torch.set_num_threads(1)
    torch_torus.init_from_launcher(timeout=datetime.timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    problems, facts = [], []
    for algorithm in ("ring", "torus"):
        group = dist.new_group(backend="torus", pg_options=torch_torus.Options(
            allreduce=algorithm, chunk_bytes="64K"))
        facts.append(f"{algorithm}:{torch_torus.algorithm_for('allreduce', 1 << 20, group)}")
        for dtype, op, shape in CASES:
            inputs = gen_all(("cluster", algorithm, dtype, op, shape), size, shape, dtype, op)
            out = inputs[rank].clone()
            dist.all_reduce(out, op=getattr(dist.ReduceOp, op), group=group)
            problems += check_reduction(out, inputs, op, f"{algorithm} {dtype} {op} {shape}")
    hosts = [None] * size
    dist.all_gather_object(hosts, (socket.gethostname(), os.readlink("/proc/self/ns/net")))
    facts.append(f"hosts={len(set(hosts))}")
    dist.destroy_process_group()
    verdict = "FAIL " + "; ".join(problems) if problems else "ok"
    # One write with its newline: the host's ranks share one stdout, and print() writes the line
    # and its end separately when Python runs unbuffered, so two ranks' lines could interleave.
    os.write(sys.stdout.fileno(), f"CLUSTER-CASE rank {rank} {verdict} {' '.join(facts)}\n".encode())
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
