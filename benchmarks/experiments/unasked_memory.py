"""How much a rank holds of what it has not asked for: issue 16's measurement.

    torchrun --standalone --nproc-per-node=2 benchmarks/experiments/unasked_memory.py --transport tcp

Rank 0 sends COUNT tensors of SIZE (each its own tag) and then a small one; rank 1 receives the
small one first, so everything before it arrives unasked, then the rest. Rank 1 prints how much
its resident memory grew while it waited for the small message, then checks every tensor. A
second scenario has rank 0 start BROADCASTS broadcasts of 2 MiB before the small message.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

import torch_torus  # noqa: F401 - registers the backend

MiB = 1 << 20
SMALL_TAG = 1_000_000  # past every other tag


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def touched(n: int) -> torch.Tensor:
    t = torch.empty(n, dtype=torch.uint8)
    t.fill_(0)
    return t


def sends_ahead(nbytes: int, count: int) -> float | None:
    rank = dist.get_rank()
    small = torch.zeros(4, dtype=torch.int32)
    if rank == 0:
        payloads = [torch.full((nbytes,), k % 251, dtype=torch.uint8) for k in range(count)]
        works = [dist.isend(p, 1, tag=k + 1) for k, p in enumerate(payloads)]
        dist.send(small, 1, tag=SMALL_TAG)
        for work in works:
            work.wait()
        return None
    received = [touched(nbytes) for _ in range(count)]
    before = rss_bytes()
    dist.recv(small, 0, tag=SMALL_TAG)
    grown = rss_bytes() - before
    for k, buf in enumerate(received):
        dist.recv(buf, 0, tag=k + 1)
        assert torch.equal(buf, torch.full_like(buf, k % 251)), f"message {k} differs"
    return grown / MiB


def root_runs_ahead(count: int) -> float | None:
    rank = dist.get_rank()
    small = torch.zeros(4, dtype=torch.int32)
    tensors = [torch.full((2 * MiB,), k % 251, dtype=torch.uint8) if rank == 0 else touched(2 * MiB)
               for k in range(count)]
    if rank == 0:
        works = [dist.broadcast(t, 0, async_op=True) for t in tensors]
        dist.send(small, 1, tag=SMALL_TAG)
        for work in works:
            work.wait()
        return None
    before = rss_bytes()
    dist.recv(small, 0, tag=SMALL_TAG)
    grown = rss_bytes() - before
    for k, t in enumerate(tensors):
        dist.broadcast(t, 0)
        assert torch.equal(t, torch.full_like(t, k % 251)), f"broadcast {k} differs"
    return grown / MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", default="tcp", choices=["tcp", "shm"])
    parser.add_argument("--size", type=int, default=128 * MiB)
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--broadcasts", type=int, default=96)
    args = parser.parse_args()
    import os

    os.environ["TORUS_TRANSPORT"] = args.transport
    dist.init_process_group("torus")
    p2p = sends_ahead(args.size, args.count)
    dist.barrier()
    collective = root_runs_ahead(args.broadcasts)
    if dist.get_rank() == 1:
        print(json.dumps({"transport": args.transport,
                          "p2p": f"{args.count} x {args.size} bytes", "p2p_grown_mib": round(p2p, 1),
                          "broadcasts": f"{args.broadcasts} x 2 MiB", "broadcast_grown_mib": round(collective, 1)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
