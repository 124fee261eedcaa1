"""Train ResNet-50 with DistributedDataParallel on synthetic data and report images/s.

The workload of the seed study (ResNet-50 data-parallel training on CPU clusters): every step
allreduces 25.6M gradients (~100 MB in float32) in DDP's buckets, so the backend's allreduce
shows in the throughput. The data is random and made once, so no input pipeline interferes.

    torchrun --nproc-per-node 4 examples/ddp_resnet50.py --image-size 32
    torchrun --nproc-per-node 4 examples/ddp_resnet50.py --backend gloo --image-size 32 --steps 5
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank $NODE --master-addr $HEAD \
        --master-port 29500 examples/ddp_resnet50.py --image-size 32          (two hosts)
    mpiexec -n 8 python examples/ddp_resnet50.py --image-size 32
    srun -N 2 --ntasks-per-node 4 python examples/ddp_resnet50.py --image-size 32

Uses torchvision's resnet50 when torchvision is installed, else torch_torus.resnet (the same
network). Under mpiexec (MPICH, Open MPI) and srun, torch_torus.launch derives torch's env://
variables from the launcher's; any other launcher that sets MASTER_ADDR, MASTER_PORT, RANK and
WORLD_SIZE works too.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def available_cores() -> int:
    # The affinity mask respects taskset and cgroup cpusets, which os.cpu_count() ignores.
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="DDP training of ResNet-50 on synthetic data, reporting images/s. "
                    "Launch one process per rank, e.g. torchrun --nproc-per-node 4 "
                    "examples/ddp_resnet50.py --image-size 32")
    parser.add_argument("--backend", default="torus",
                        help="torch.distributed backend: torus (imports torch_torus) or gloo, or "
                             "any other registered one (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="images per rank and step (default: %(default)s)")
    parser.add_argument("--image-size", type=int, default=224,
                        help="height and width of the synthetic images; 32 makes a CPU step "
                             "fast while the gradients stay as large (default: %(default)s)")
    parser.add_argument("--num-classes", type=int, default=1000,
                        help="classes of the synthetic labels and the last layer (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20,
                        help="timed training steps (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=3,
                        help="untimed steps first: allocation, DDP's bucket rebuild after the "
                             "first step and connection setup fall here (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default: %(default)s)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda uses GPU LOCAL_RANK modulo the GPU count (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads per rank; the default shares this host's cores "
                             "among its LOCAL_WORLD_SIZE ranks, since more threads than cores "
                             "makes every rank slower")
    parser.add_argument("--compare", metavar="BACKEND", default=None,
                        help="then train again over a group of this backend (e.g. gloo) and print "
                             "both figures side by side")
    parser.add_argument("--comm-hook", choices=sorted(COMM_HOOKS), default="allreduce",
                        help="how DDP communicates gradients: allreduce (DDP's own), noop (no "
                             "communication at all: the compute-only bound), fp16 (compressed to "
                             "half), powersgd (torch's PowerSGD, rank 1, from step 2: collectives "
                             "issued from its futures' callbacks) (default: %(default)s)")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup_steps < 0:
        parser.error("--steps must be at least 1 and --warmup-steps at least 0")
    return args


def register_comm_hook(model: DistributedDataParallel, name: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks, powerSGD_hook

    if name == "noop":
        model.register_comm_hook(None, debugging_hooks.noop_hook)
    elif name == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


COMM_HOOKS = {"allreduce", "noop", "fp16", "powersgd"}


def resnet50(num_classes: int) -> tuple[nn.Module, str]:
    """The model and where it came from."""
    try:
        from torchvision.models import resnet50 as torchvision_resnet50
    except ImportError:
        from torch_torus.resnet import resnet50 as torch_torus_resnet50

        return torch_torus_resnet50(num_classes=num_classes), "torch_torus.resnet (no torchvision)"
    return torchvision_resnet50(num_classes=num_classes), "torchvision.models"


def init_env_from_launcher() -> None:
    """torch's env:// variables under mpiexec and srun too (torchrun sets them itself)."""
    try:
        from torch_torus.launch import LaunchError, init_env_from_launcher as from_launcher
    except ImportError:
        return  # --backend gloo without torch_torus: torchrun and the like only
    try:
        from_launcher()
    except LaunchError as error:
        raise SystemExit(f"ddp_resnet50: {error}") from error


def main() -> None:
    args = parse_args()
    if args.backend == "torus":
        try:
            import torch_torus  # noqa: F401  (registers the backend)
        except ImportError as error:
            raise SystemExit(f"--backend torus needs the torch_torus package, which does not "
                             f"import ({error}); --backend gloo runs without it") from error
    init_env_from_launcher()
    if args.threads is None:
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        args.threads = max(1, available_cores() // ranks_here)
    torch.set_num_threads(args.threads)

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend=args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    say("synthetic data: each rank's one random batch, reused every step, so the loss falls as the "
        "model memorises it; the figure that counts is images/s")

    def train(group: dist.ProcessGroup | None, backend: str) -> tuple[DistributedDataParallel, float]:
        """DDP over `group` (None: the default one) for the warmup and timed steps; the model and
        the images/s of all ranks together."""
        model, model_source = resnet50(args.num_classes)
        parameters = sum(p.numel() for p in model.parameters())
        # DDP starts every rank from rank 0's weights; the device ids tell it which GPU is ours.
        model = DistributedDataParallel(model.to(device), process_group=group,
                                        device_ids=[device.index] if device.type == "cuda" else None)
        register_comm_hook(model, args.comm_hook)
        say(f"ResNet-50 from {model_source}: {parameters:,} parameters; backend {backend}, "
            f"comm hook {args.comm_hook}, "
            f"{world_size} ranks, batch {args.batch_size} per rank, {args.image_size}x{args.image_size} "
            f"images, {args.threads} threads per rank, device {args.device}")

        # Each rank its own random batch, made once and reused every step.
        generator = torch.Generator().manual_seed(rank)
        images = torch.randn(args.batch_size, 3, args.image_size, args.image_size,
                             generator=generator).to(device)
        labels = torch.randint(0, args.num_classes, (args.batch_size,), generator=generator).to(device)
        loss_function = nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)

        total_steps = args.warmup_steps + args.steps
        for step in range(total_steps):
            if step == args.warmup_steps:
                dist.barrier()  # all ranks start the timed steps together
                timed_start = time.perf_counter()
            step_start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_function(model(images), labels)
            loss.backward()  # DDP allreduces the gradients here, bucket by bucket
            optimizer.step()
            loss_value = loss.item()  # waits for the step to finish, on a GPU too
            phase = "(warmup)" if step < args.warmup_steps else "(timed)"
            say(f"step {step + 1:>4}/{total_steps} {phase:<8}  loss {loss_value:7.4f}  "
                f"{time.perf_counter() - step_start:7.3f} s")
        images_per_second = args.batch_size * args.steps / (time.perf_counter() - timed_start)

        def over_ranks(op: dist.ReduceOp) -> float:
            value = torch.tensor([images_per_second], dtype=torch.float64, device=device)
            dist.all_reduce(value, op=op)
            return value.item()

        slowest, fastest, total = (over_ranks(op) for op in
                                   (dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.SUM))
        say(f"images/s per rank: {total / world_size:.2f} mean ({slowest:.2f} slowest, "
            f"{fastest:.2f} fastest)")
        say(f"images/s total:    {total:.2f} over {world_size} ranks")
        return model, total

    model, total = train(None, args.backend)
    if args.backend == "torus":
        # DDP allreduces gradients in buckets of about bucket_bytes_cap (25 MiB by default; a
        # bucket closes at the first parameter that reaches the cap, so some are larger).
        bucket_bytes = model.bucket_bytes_cap
        try:
            import torch_torus

            algorithm = torch_torus.algorithm_for("allreduce", bucket_bytes, dist.group.WORLD)
        except Exception as error:  # algorithm_for is newer than the backend; reporting is optional
            algorithm = f"unknown ({type(error).__name__}: {error})"
        say(f"torus allreduce algorithm for {bucket_bytes / 2**20:g} MiB gradient buckets: {algorithm}")
    if args.compare:
        say(f"the same over {args.compare}:")
        _, theirs = train(dist.new_group(backend=args.compare), args.compare)
        say(f"images/s total: {args.backend} {total:.2f}, {args.compare} {theirs:.2f} "
            f"({args.backend} / {args.compare} = {total / theirs:.2f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
