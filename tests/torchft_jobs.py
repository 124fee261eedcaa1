"""One torchft replica (one process, a replica group of one rank), for tests/test_torchft.py.

python tests/torchft_jobs.py --backend torus --replica 1 --lighthouse ADDR --steps 6 \
    --kill between:3 --scratch DIR

Trains a small MLP with torchft's Manager and OptimizerWrapper over
torch_torus.torchft.ProcessGroupTorus (or torchft's ProcessGroupGloo), min_replica_size 2, the
quorum synchronous, until the Manager's step reaches --steps. The gradients are averaged as DDP's
one bucket is, through Manager.allreduce; not by torchft 0.2.0's DistributedDataParallel, whose
comm hook fails backward() when the allreduce fails (AssertionError at `assert fut._fut`), so that
a replica whose peer died in the allreduce dies too (torchft's later releases skip the step).
Every step's inputs depend only on (replica, step), and a step is committed only with both
replicas' gradients, so the final parameters do not depend on how many attempts a step took: they
are the same over every backend and every kill schedule whose steps end committed.

--kill between:S: the replica SIGKILLs itself once step S-1 is committed, before step S's quorum.
--kill allreduce:S: at step S it enters the gradient allreduce, waits until the other replica has
issued its own (a file it leaves in --scratch), and SIGKILLs itself there, so that the other's
allreduce is in flight when its peer dies.
At the end it writes --scratch/replica<R>.json: the parameters, the steps whose attempts were not
committed, and whether torchft's Manager ever saw its process group errored."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torchft import Manager
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

from torch_torus.torchft import ProcessGroupTorus

# How long a replica waits for the other's mark before it gives up (a bound, never reached when
# both are alive).
MARK_TIMEOUT = 60.0


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)


def _average_gradients(manager: Manager, model: torch.nn.Module) -> None:
    """DDP's gradient bucket: one allreduce of every gradient, through torchft's Manager, which
    reports a failure to should_commit rather than raise."""
    grads = [p.grad for p in model.parameters()]
    bucket = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(bucket).wait()
    for grad, averaged in zip(grads, torch._utils._unflatten_dense_tensors(bucket, grads)):
        grad.copy_(averaged)


def _mark(scratch: str, name: str) -> None:
    open(os.path.join(scratch, name), "w").close()


def _wait_for_mark(scratch: str, name: str) -> None:
    deadline = time.monotonic() + MARK_TIMEOUT
    while not os.path.exists(os.path.join(scratch, name)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {name} in {scratch} within {MARK_TIMEOUT} s")
        time.sleep(0.005)


def _watch_allreduce(pg, manager: Manager, replica: int, kill: tuple[str, int] | None, scratch: str) -> None:
    """Marks each gradient allreduce of the process group torchft's Manager calls once it is issued,
    and kills this replica inside the one --kill allreduce:S names."""
    allreduce = pg.allreduce

    def watched(tensors, opts):
        step = manager.current_step()
        if kill and kill == ("allreduce", step):
            _wait_for_mark(scratch, f"issued-{1 - replica}-{step}")
            os.kill(os.getpid(), signal.SIGKILL)
        work = allreduce(tensors, opts)
        _mark(scratch, f"issued-{replica}-{step}")
        return work

    pg.allreduce = watched


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("torus", "gloo"), required=True)
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill", default="", help="between:STEP or allreduce:STEP")
    parser.add_argument("--scratch", required=True)
    parser.add_argument("--timeout", type=float, default=20.0)
    args = parser.parse_args()
    kill = None
    if args.kill:
        where, step = args.kill.split(":")
        kill = (where, int(step))

    timeout = timedelta(seconds=args.timeout)
    pg = ProcessGroupTorus(timeout=timeout) if args.backend == "torus" else ProcessGroupGloo(timeout=timeout)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    # The replica group's store: its one rank hosts it.
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=pg, min_replica_size=2, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=str(args.replica), store_addr="localhost", store_port=store.port, rank=0,
                      world_size=1, lighthouse_addr=args.lighthouse, port=0, use_async_quorum=False,
                      timeout=timeout, quorum_timeout=timedelta(seconds=120), connect_timeout=timeout)
    _watch_allreduce(pg, manager, args.replica, kill, args.scratch)
    wrapped = OptimizerWrapper(manager, optimizer)
    uncommitted, errored = [], False
    while manager.current_step() < args.steps:
        if kill == ("between", manager.current_step()):
            os.kill(os.getpid(), signal.SIGKILL)
        wrapped.zero_grad()  # the quorum: a replica that heals takes the step it heals to
        step = manager.current_step()
        inputs, targets = _batch(args.replica, step)
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        _average_gradients(manager, model)
        errored = errored or pg.errored() is not None or manager.errored() is not None
        wrapped.step()
        if manager.current_step() == step:
            uncommitted.append(step)
    result = {"parameters": {name: p.detach().tolist() for name, p in model.named_parameters()},
              "uncommitted": uncommitted, "errored": errored}
    with open(os.path.join(args.scratch, f"replica{args.replica}.json"), "w") as out:
        json.dump(result, out)
    manager.shutdown(wait=False)
    pg.shutdown()


if __name__ == "__main__":
    main()
