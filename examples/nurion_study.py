"""The seed study's experiment on the ranks at hand: DDP ResNet-50, synthetic data, batch 8 per
rank, images/s per rank for each allreduce algorithm, as the study's table and figure.

    torchrun --nproc-per-node 4 examples/nurion_study.py --image-size 32 --plot study.png

The study (Nurion, KNL nodes, Omni-Path) set the algorithm with CCL_ALLREDUCE and measured
16 to 1024 nodes; here each algorithm is set the same way, as the allreduce setting
(TORUS_ALLREDUCE's Options keyword) of its own process group, and every algorithm trains the
same network from the same weights in turn within one launch, so all meet the same machine.
Larger node counts are the model's: python -m torch_torus.model --preset nurion.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_torus
from torch_torus.config import resolve
from torch_torus.launch import threads_per_rank
from torch_torus.resnet import resnet50
from torch_torus.selection import allreduce_candidates
from torch_torus.topology import choose_grid, choose_transport, host_identity


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8, help="images per rank and step (default: %(default)s)")
    parser.add_argument("--image-size", type=int, default=224,
                        help="synthetic image side; 32 keeps a CPU step short, the gradients as large (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per algorithm (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first (default: %(default)s)")
    parser.add_argument("--algorithms", default=None,
                        help="comma list (default: every algorithm auto may choose for this job, then auto)")
    parser.add_argument("--json", metavar="PATH", help="write the table as JSON")
    parser.add_argument("--plot", metavar="PNG", help="draw images/s per rank for each algorithm")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup_steps < 0:
        parser.error("--steps must be at least 1 and --warmup-steps at least 0")
    return args


def train(group: dist.ProcessGroup, args: argparse.Namespace, rank: int) -> float:
    """images/s of this rank over the timed steps."""
    torch.manual_seed(0)  # the same weights for every algorithm (DDP broadcasts rank 0's anyway)
    model = DistributedDataParallel(resnet50(num_classes=1000), process_group=group)
    generator = torch.Generator().manual_seed(rank)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator)
    labels = torch.randint(0, 1000, (args.batch_size,), generator=generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_function = nn.CrossEntropyLoss()
    for step in range(args.warmup_steps + args.steps):
        if step == args.warmup_steps:
            dist.barrier(group=group)
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_function(model(images), labels).backward()
        optimizer.step()
    return args.batch_size * args.steps / (time.perf_counter() - start)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(threads_per_rank())
    dist.init_process_group(backend="gloo")  # gathering results, the same for every algorithm
    rank, world_size = dist.get_rank(), dist.get_world_size()
    values = resolve(None)
    hosts: list[str] = [""] * world_size
    dist.all_gather_object(hosts, values["host_id"] or host_identity())
    grid = choose_grid(world_size, hosts, values["torus_dims"])
    algorithms = (args.algorithms.split(",") if args.algorithms else [*allreduce_candidates(grid, choose_transport(values["transport"], hosts)), "auto"])
    bucket = 25 << 20
    results = []
    for algorithm in algorithms:
        group = dist.new_group(backend="torus", pg_options=torch_torus.Options(allreduce=algorithm))
        rate = torch.tensor([train(group, args, rank)], dtype=torch.float64)
        dist.all_reduce(rate)  # gloo world: the sum over ranks
        results.append({"algorithm": algorithm, "images_per_second_per_rank": rate.item() / world_size,
                        "runs_for_25MiB_buckets": torch_torus.algorithm_for("allreduce", bucket, group)})
        if rank == 0:
            print(f"{algorithm:>20}: {results[-1]['images_per_second_per_rank']:.3f} images/s per rank "
                  f"(25 MiB buckets run {results[-1]['runs_for_25MiB_buckets']})", flush=True)
    if rank == 0:
        best = max(results, key=lambda r: r["images_per_second_per_rank"])
        grid_text = f"{grid.shape[0]}x{grid.shape[1]}" if grid else "none"
        print(f"\n| ranks | torus grid | " + " | ".join(r["algorithm"] for r in results) + " | best |")
        print("|---|---|" + "---|" * len(results) + "---|")
        print(f"| {world_size} | {grid_text} | " + " | ".join(f"{r['images_per_second_per_rank']:.2f}" for r in results)
              + f" | {best['algorithm']} |")
        if args.json:
            with open(args.json, "w") as file:
                json.dump({"world_size": world_size, "grid": grid.shape if grid else None, "batch_per_rank": args.batch_size,
                           "image_size": args.image_size, "steps": args.steps, "results": results}, file, indent=1)
        if args.plot:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            figure, axes = plt.subplots(figsize=(7, 4))
            axes.bar([r["algorithm"] for r in results], [r["images_per_second_per_rank"] for r in results])
            axes.set_ylabel("images/s per rank")
            axes.set_title(f"DDP ResNet-50, {world_size} ranks, batch {args.batch_size}/rank, "
                           f"{args.image_size}px synthetic")
            plt.setp(axes.get_xticklabels(), rotation=20)
            figure.tight_layout()
            figure.savefig(args.plot, dpi=110)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
