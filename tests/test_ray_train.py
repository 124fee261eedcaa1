"""Ray Train (2.60) with torus: `TorchTrainer` with `TorchConfig(backend="torus")` and 2 CPU
workers, no setup hook (the workers' `import torch` registers "torus": test_autoload.py), trains a
small model under DDP (`ray.train.torch.prepare_model`) to bitwise the same losses and parameters as
`TorchConfig(backend="gloo")` on the same seeds: with 2 ranks an allreduce's sum is a + b on either
backend. Skips where Ray Train is not installed (`pip install 'ray[train]==2.60.0' torch==2.13.0`).
One Ray instance for both runs, in a driver process of its own bounded by DRIVER_TIMEOUT_S; about
1-3 min on 2 cores."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

pytest.importorskip("ray.train.torch", reason="Ray Train is not installed (pip install 'ray[train]==2.60.0' torch==2.13.0)")

DRIVER_TIMEOUT_S = 600
BACKENDS = ("torus", "gloo")

DRIVER = """
import json, os, sys
import ray, ray.train
from ray.train.torch import TorchConfig, TorchTrainer

def train(config):
    import torch
    import torch.distributed as dist
    import ray.train.torch
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(5):
        x = torch.randn(32, 8, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    record = {"losses": losses, "params": [p.detach().flatten().tolist() for p in model.parameters()],
              "backend": dist.get_backend(),
              "cpu_backend": type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__}
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
        json.dump(record, f)

out, backends = sys.argv[1], sys.argv[2].split(",")
ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
for backend in backends:
    os.makedirs(os.path.join(out, backend))
    TorchTrainer(train, train_loop_config={"out": os.path.join(out, backend)},
                 torch_config=TorchConfig(backend=backend),
                 scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
                 run_config=ray.train.RunConfig(storage_path=os.path.join(out, "storage"), name=backend)).fit()
ray.shutdown()
"""


def test_torch_trainer_with_backend_torus_matches_gloo_bitwise(tmp_path):
    assert [e for e in entry_points(group="torch.backends") if e.name == "torus"], \
        "torch-torus is not installed: Ray's workers could not take backend='torus' (pip install -e .)"
    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(DRIVER), str(tmp_path), ",".join(BACKENDS)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = driver.communicate(timeout=DRIVER_TIMEOUT_S)
    finally:
        if driver.poll() is None:  # Ray's own processes share the driver's session
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    assert driver.returncode == 0, f"the Ray driver exited {driver.returncode}:\n{output[-6000:]}"
    runs = {backend: [json.loads((tmp_path / backend / f"rank{rank}.json").read_text()) for rank in range(2)]
            for backend in BACKENDS}
    torus, gloo = runs["torus"], runs["gloo"]
    assert [r["backend"] for r in torus] == ["torus"] * 2
    assert [r["cpu_backend"] for r in torus] == ["ProcessGroupTorus"] * 2
    assert [r["cpu_backend"] for r in gloo] == ["ProcessGroupGloo"] * 2
    assert torus[0]["params"] == torus[1]["params"], "DDP over torus left the ranks' parameters apart"
    assert [r["losses"] for r in torus] == [r["losses"] for r in gloo]
    assert [r["params"] for r in torus] == [r["params"] for r in gloo]
    assert torus[0]["losses"] != torus[1]["losses"], "each rank should train on its own data"
