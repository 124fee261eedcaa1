"""One rank of a DeepSpeed ZeRO job on CPU, for tests/test_deepspeed.py.

RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 DS_ACCELERATOR=cpu \
    python tests/deepspeed_jobs.py --backend torus --stage 3 --out rank0.json

Trains a small MLP with ``deepspeed.initialize`` (ZeRO stage --stage, fp32, torch's Adam) for
--steps steps on inputs that depend only on (rank, step), and writes one JSON file: the backend
torch.distributed reports and the one the group's CPU backend object says it is
(torch_torus.backend_of), the loss of every step, and the full parameters at the end (gathered
under ZeRO-3). --backend names the backend given to ``deepspeed.init_distributed``; "default"
skips that call, so that ``deepspeed.initialize`` creates the process group itself with the CPU
accelerator's choice; "torch:<name>" creates it with ``torch.distributed.init_process_group``
before DeepSpeed sees it."""

from __future__ import annotations

import argparse
import json

import deepspeed
import torch
import torch.distributed as dist

import torch_torus


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Sizes that split unevenly over 2 ranks, so that ZeRO pads its partitions.
    return torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 5))


def _batch(rank: int, step: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(micro_batch, 13, generator=generator), torch.randn(micro_batch, 5, generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True,
                        help='"torus", "gloo", "default" (no init_distributed) or "torch:<backend>"')
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    if args.backend.startswith("torch:"):
        dist.init_process_group(args.backend.removeprefix("torch:"))
    elif args.backend != "default":
        deepspeed.init_distributed(dist_backend=args.backend)
    micro_batch = 4
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 1000,
    }
    model = _model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = dist.get_rank()
    losses = []
    for step in range(args.steps):
        inputs, targets = _batch(rank, step, micro_batch)
        loss = torch.nn.functional.mse_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=args.stage == 3):
        parameters = {name: p.detach().clone().tolist() for name, p in engine.module.named_parameters()}
    with open(args.out, "w") as out:
        json.dump({"backend": dist.get_backend(), "backend_in_use": torch_torus.backend_of(device="cpu"), "losses": losses, "parameters": parameters}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
