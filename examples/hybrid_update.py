"""Train with the hybrid update (synchronous inside a host, asynchronous across hosts) against
plain DDP and torch's blocking periodic averaging; report images/s and bytes sent between hosts.

    torchrun --nproc-per-node 4 examples/hybrid_update.py --task resnet50 --mode hybrid --period 8 --delay 4
    python -m benchmarks.cluster --hosts 2 --nproc-per-host 4 --link 100mbit -- \\
        examples/hybrid_update.py --task resnet50 --mode hybrid --period 8 --delay 4 --steps 32
    python -m benchmarks.cluster --hosts 2 --nproc-per-host 4 --link 1gbit -- \\
        examples/hybrid_update.py --task digits --mode periodic --period 8 --seed 1

Modes:
  sync      DistributedDataParallel over every rank: gradients allreduced across hosts each step.
  periodic  torch's post-local SGD: DDP over every rank with post_localSGD_hook (gradients
            allreduced inside the host after the warm-up) and PeriodicModelAverager (a blocking
            allreduce of the parameters over every rank every --period steps).
  hybrid    torch_torus.HybridAverager: DDP over the host's group, and every --period steps an
            average across hosts started in the background and applied --delay steps later.

Tasks:
  resnet50  ResNet-50 (torch_torus.resnet) on synthetic images, as examples/ddp_resnet50.py:
            --warmup-steps untimed steps (synchronous in periodic and hybrid), then --steps timed.
  digits    a small CNN on scikit-learn's digits (1797 8x8 images shipped inside scikit-learn:
            pip install 'torch-torus[hybrid]' or scikit-learn), --epochs over 1500 training
            images with a global batch of --batch-size, a cosine learning rate, the first
            --warmup-steps steps synchronous; the accuracy on the 297 others at the end.

Hosts are the ones the torus backend finds (host name, boot id, namespaces; TORUS_HOST_ID).
The last line printed is one JSON object: mode, task, period, delay, images_per_s (all ranks
together), cross_host_bytes_per_step (sent to other hosts by all ranks, from
torch_torus.traffic, over the timed steps) and accuracy (digits; null for resnet50).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_torus
from torch_torus.launch import threads_per_rank

DIGITS_TRAINING_IMAGES = 1500  # of 1797; the rest are the test set


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="The hybrid update against DDP and torch's periodic averaging: images/s and "
                    "bytes between hosts. Launch one process per rank, e.g. torchrun "
                    "--nproc-per-node 4 examples/hybrid_update.py --task resnet50 --mode hybrid")
    parser.add_argument("--task", choices=["resnet50", "digits"], required=True)
    parser.add_argument("--mode", choices=["sync", "hybrid", "periodic"], required=True)
    parser.add_argument("--period", type=int, default=8,
                        help="steps between averages across hosts (H; periodic and hybrid; default: %(default)s)")
    parser.add_argument("--delay", type=int, default=None,
                        help="hybrid: steps from the start of an average to its application "
                             "(τ, 0 to --period; default: --period / 2, rounded down)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="resnet50: images per rank and step (default 8); digits: images per "
                             "step over all ranks (default 64)")
    parser.add_argument("--steps", type=int, default=20, help="resnet50: timed steps (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=3,
                        help="first steps, synchronous in periodic and hybrid; resnet50 does not "
                             "time them (default: %(default)s)")
    parser.add_argument("--image-size", type=int, default=32,
                        help="resnet50: height and width of the synthetic images (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=15, help="digits: epochs (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=None,
                        help="SGD learning rate (default 0.01 for resnet50, 0.1 for digits, "
                             "cosine-annealed over the run for digits)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the model's initial weights and the order of the data (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads per rank; the default shares this host's cores "
                             "among its LOCAL_WORLD_SIZE ranks")
    args = parser.parse_args()
    if args.period < 1:
        parser.error(f"--period must be at least 1, got {args.period}")
    if args.delay is None:
        args.delay = args.period // 2 if args.mode == "hybrid" else 0
    if not 0 <= args.delay <= args.period:
        parser.error(f"--delay must be from 0 to --period={args.period}, got {args.delay}")
    if args.mode == "periodic" and args.delay:
        parser.error(f"--delay {args.delay}: torch's periodic averaging is blocking (delay 0); "
                     "--mode hybrid delays the average")
    if args.steps < 1 or args.warmup_steps < 0 or args.epochs < 1:
        parser.error(f"--steps ({args.steps}) and --epochs ({args.epochs}) must be at least 1, "
                     f"--warmup-steps ({args.warmup_steps}) at least 0")
    if args.batch_size is None:
        args.batch_size = 8 if args.task == "resnet50" else 64
    if args.lr is None:
        args.lr = 0.01 if args.task == "resnet50" else 0.1
    return args


class DigitsNet(nn.Module):
    """A small CNN for 8x8 digits, with BatchNorm so that buffers are averaged too."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def load_digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as (train images, train labels, test images, test labels), split
    the same way whatever --seed says."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as error:
        raise SystemExit("--task digits needs scikit-learn (its digits ship inside it, no download): "
                         "pip install scikit-learn, or pip install 'torch-torus[hybrid]'") from error
    digits = sklearn_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    images, labels = (images[order] - 0.5) / 0.5, labels[order]
    n = DIGITS_TRAINING_IMAGES
    return images[:n], labels[:n], images[n:], labels[n:]


def main() -> None:
    args = parse_args()
    torch_torus.init_from_launcher()
    if args.threads is None:
        args.threads = threads_per_rank()
    torch.set_num_threads(args.threads)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    if args.task == "resnet50":
        from torch_torus.resnet import resnet50

        torch.manual_seed(args.seed)
        module = resnet50(num_classes=1000)
        per_rank_batch = args.batch_size
        generator = torch.Generator().manual_seed(rank)
        images = torch.randn(per_rank_batch, 3, args.image_size, args.image_size, generator=generator)
        labels = torch.randint(0, 1000, (per_rank_batch,), generator=generator)
        total_steps = args.warmup_steps + args.steps
        timed_from = args.warmup_steps
        batches = ((images, labels) for _ in range(total_steps))
    else:
        if args.batch_size % world_size:
            raise SystemExit(f"--batch-size {args.batch_size} (over all ranks) must be a multiple of "
                             f"the {world_size} ranks")
        train_images, train_labels, test_images, test_labels = load_digits()
        torch.manual_seed(args.seed)
        module = DigitsNet()
        per_rank_batch = args.batch_size // world_size
        steps_per_epoch = DIGITS_TRAINING_IMAGES // args.batch_size
        total_steps = args.epochs * steps_per_epoch
        timed_from = 0

        def digits_batches():
            # Every mode sees the same global batches; each rank its slice of them.
            for epoch in range(args.epochs):
                order = torch.randperm(DIGITS_TRAINING_IMAGES,
                                       generator=torch.Generator().manual_seed(1000 * args.seed + epoch))
                for step in range(steps_per_epoch):
                    batch = order[step * args.batch_size:(step + 1) * args.batch_size]
                    mine = batch[rank * per_rank_batch:(rank + 1) * per_rank_batch]
                    yield train_images[mine], train_labels[mine]

        batches = digits_batches()

    # Made in every mode (sync does not use them) so that each mode's traffic is counted alike.
    groups = torch_torus.host_groups()
    counted = [None, groups.host, groups.cross]
    averager = None
    if args.mode == "sync":
        model = DistributedDataParallel(module)
    elif args.mode == "periodic":
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (PostLocalSGDState,
                                                                                     post_localSGD_hook)
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        model = DistributedDataParallel(module)
        model.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=groups.host,
                                                   start_localSGD_iter=args.warmup_steps), post_localSGD_hook)
        periodic = PeriodicModelAverager(period=args.period, warmup_steps=args.warmup_steps)
    else:
        # Gradients and DDP's buffer broadcast at every forward stay inside the host.
        model = DistributedDataParallel(module, process_group=groups.host)
        averager = torch_torus.HybridAverager(model, groups, period=args.period, delay=args.delay,
                                              warmup_steps=args.warmup_steps)
    parameters = sum(p.numel() for p in module.parameters())
    say(f"{args.task}: {parameters:,} parameters; mode {args.mode}, period {args.period}, delay "
        f"{args.delay}, {world_size} ranks on {groups.num_hosts} hosts, batch {per_rank_batch} per rank, "
        f"{total_steps} steps ({args.warmup_steps} warm-up), {args.threads} threads per rank")

    loss_function = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    if args.task == "digits":
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / total_steps)))
    for step, (images, labels) in enumerate(batches):
        if step == timed_from:
            dist.barrier()  # all ranks start the timed steps together
            for group in counted:
                torch_torus.reset_traffic(group)
            timed_start = time.perf_counter()
        step_start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_function(model(images), labels)
        loss.backward()
        optimizer.step()
        if args.task == "digits":
            schedule.step()
        if args.mode == "periodic":
            periodic.average_parameters(model.parameters())
        elif averager is not None:
            averager.step()
        loss_value = loss.item()
        if args.task == "resnet50" or (step + 1) % steps_per_epoch == 0:
            phase = "(warmup)" if step < args.warmup_steps else ""
            say(f"step {step + 1:>4}/{total_steps} {phase:<8}  loss {loss_value:7.4f}  "
                f"{time.perf_counter() - step_start:7.3f} s")
    if averager is not None:
        # The last average started is timed and counted whole, as torch's blocking ones are.
        averager.finish()
    elapsed = time.perf_counter() - timed_start
    cross_host_bytes = sum(torch_torus.traffic(group)["other_host_bytes"] for group in counted)
    timed_steps = total_steps - timed_from

    # Every rank the same model for evaluation: one more average, blocking.
    drain_start = time.perf_counter()
    if averager is not None:
        averager.drain()
    elif args.mode == "periodic":
        from torch.distributed.algorithms.model_averaging.utils import average_parameters

        average_parameters(iter(model.parameters()), dist.group.WORLD)
    say(f"final average: {time.perf_counter() - drain_start:.3f} s (not timed)")

    accuracy = None
    if args.task == "digits":
        module.eval()
        with torch.no_grad():
            accuracy = (module(test_images).argmax(1) == test_labels).float().mean().item() * 100

    mine = torch.tensor([per_rank_batch * timed_steps / elapsed, float(cross_host_bytes)], dtype=torch.float64)
    everyone = torch.empty(world_size, 2, dtype=torch.float64)
    dist.all_gather_single(everyone, mine)
    per_rank = everyone[:, 0].tolist()
    images_per_s = sum(per_rank)
    bytes_per_step = everyone[:, 1].sum().item() / timed_steps
    say(f"images/s per rank: {' '.join(f'{v:.2f}' for v in per_rank)}")
    say(f"images/s total:    {images_per_s:.2f} over {world_size} ranks")
    per_rank_bytes = " ".join(f"{b / timed_steps / 1e6:.3f}" for b in everyone[:, 1].tolist())
    say(f"bytes sent to other hosts: {bytes_per_step / 1e6:.3f} MB per step over all ranks "
        f"({timed_steps} steps; per rank: {per_rank_bytes} MB)")
    if accuracy is not None:
        say(f"test accuracy: {accuracy:.2f}% (rank 0's model, {len(test_labels)} images)")
    say(json.dumps({"mode": args.mode, "task": args.task,
                    "period": None if args.mode == "sync" else args.period,
                    "delay": None if args.mode == "sync" else args.delay,
                    "images_per_s": round(images_per_s, 3),
                    "cross_host_bytes_per_step": round(bytes_per_step),
                    "accuracy": None if accuracy is None else round(accuracy, 2)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
