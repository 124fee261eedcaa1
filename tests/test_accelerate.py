"""accelerate (1.15) with torus, as docs/frameworks.md says to run it: under `accelerate launch`
(2 processes on CPU: ACCELERATE_USE_CPU=1 with --multi_gpu, accelerate's torchrun launcher; --cpu
alone starts one process where no mpirun hostfile is given), the script creates the torus group
with `dist.init_process_group("torus")` before `Accelerator()`, which then trains under DDP over it
to bitwise the same losses and parameters as accelerate's own gloo group on the same seeds (2
ranks: an allreduce's sum is a + b on either backend). Also the silent trap the page warns of:
without ACCELERATE_USE_CPU (or cpu=True) on a CPU-only host, accelerate ignores the group and each
rank trains alone. Skips where accelerate is not installed (`pip install accelerate==1.15.0
torch==2.13.0`); about 30 s."""

import json
import os
import signal
import socket
import subprocess
import sys

from importlib.metadata import entry_points

import pytest

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install accelerate==1.15.0 torch==2.13.0)")

LAUNCH_TIMEOUT_S = 300

SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
from accelerate import Accelerator

backend, out = sys.argv[1], sys.argv[2]
if backend == "torus":
    dist.init_process_group("torus")
accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
losses = []
for xb, yb in data:
    loss = torch.nn.functional.mse_loss(model(xb), yb)
    optimizer.zero_grad()
    accelerator.backward(loss)
    optimizer.step()
    losses.append(loss.item())
import torch_torus
record = {"losses": losses, "params": [p.detach().flatten().tolist() for p in accelerator.unwrap_model(model).parameters()],
          "processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
          "backend_of": torch_torus.backend_of(), "model": type(model).__name__}
with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(record, f)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, backend: str, use_cpu: bool) -> list[dict]:
    """The script under `accelerate launch` on 2 processes; each rank's record."""
    assert [e for e in entry_points(group="torch.backends") if e.name == "torus"], \
        "torch-torus is not installed: the script's init_process_group('torus') needs it (pip install -e .)"
    script, out = tmp_path / "train.py", tmp_path / f"{backend}-{use_cpu}"
    script.write_text(SCRIPT)
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    if use_cpu:
        env["ACCELERATE_USE_CPU"] = "1"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), str(script), backend, str(out)]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True, cwd=tmp_path)
    try:
        output, _ = launcher.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        if launcher.poll() is None:  # the ranks share the launcher's session
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 0, f"accelerate launch exited {launcher.returncode}:\n{output[-6000:]}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_accelerate_over_a_torus_group_matches_its_gloo_bitwise(tmp_path):
    torus, gloo = launch(tmp_path, "torus", True), launch(tmp_path, "gloo", True)
    for run, backend in ((torus, "torus"), (gloo, "gloo")):
        assert [r["backend_of"] for r in run] == [backend] * 2
        assert [(r["processes"], r["distributed_type"], r["model"]) for r in run] == \
            [(2, "DistributedType.MULTI_CPU", "DistributedDataParallel")] * 2
    assert torus[0]["params"] == torus[1]["params"], "DDP over torus left the ranks' parameters apart"
    assert torus[0]["losses"] != torus[1]["losses"], "each rank should train on its own shard"
    assert [r["losses"] for r in torus] == [r["losses"] for r in gloo]
    assert [r["params"] for r in torus] == [r["params"] for r in gloo]


def test_without_use_cpu_accelerate_ignores_the_group_and_each_rank_trains_alone(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: accelerate picks it, the trap is a CPU-only host's")
    alone = launch(tmp_path, "torus", False)
    assert [(r["processes"], r["distributed_type"], r["model"]) for r in alone] == \
        [(1, "DistributedType.NO", "Sequential")] * 2
    assert [r["backend_of"] for r in alone] == ["torus"] * 2
    assert alone[0]["losses"] == alone[1]["losses"], "each rank alone sees the whole data set"
    assert alone[0]["params"] == alone[1]["params"]
