"""The backend name "torus" without `import torch_torus`: torch's "torch.backends" entry point
registers it at `import torch` (torch_torus_autoload.py) with a creator that loads the extension on
first use; TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns it off; a registration that fails is a warning,
never a failed `import torch`. And `torch_torus.backend_of`, which says what a group really runs on.
Every case runs in fresh interpreters (what `import torch` loads is the point)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from importlib.metadata import entry_points

import pytest

RUN_TIMEOUT_S = 120

installed = pytest.mark.skipif(
    not [e for e in entry_points(group="torch.backends") if e.name == "torus"],
    reason="torch-torus is not installed, so torch has no entry point to load (pip install --no-build-isolation -e .)")


def python(code: str, env: dict | None = None, args=()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, env=dict(os.environ, **(env or {})))


def last_json(result: subprocess.CompletedProcess):
    assert result.returncode == 0, f"exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_ranks(code: str, size: int, tmp_path) -> list:
    """`code` on `size` ranks of fresh interpreters (argv: rank, size, store file); each prints one
    JSON line last. A rank that fails fails the job at once; none outlives RUN_TIMEOUT_S."""
    store = tmp_path / "store"
    logs = [(open(tmp_path / f"rank{rank}.out", "w"), open(tmp_path / f"rank{rank}.err", "w")) for rank in range(size)]
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(rank), str(size), str(store)],
                              stdout=out, stderr=err) for rank, (out, err) in enumerate(logs)]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        # A rank that fails ends the job: its peers would otherwise wait for it in the store.
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            assert time.monotonic() < deadline, f"the ranks did not end within {RUN_TIMEOUT_S} s"
            time.sleep(0.05)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for files in logs:
        for file in files:
            file.close()
    outputs = [((tmp_path / f"rank{rank}.out").read_text(), (tmp_path / f"rank{rank}.err").read_text())
               for rank in range(size)]
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{out}\n{err}"
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


@installed
def test_import_torch_registers_torus_and_loads_no_torus_library():
    state = last_json(python("""
        import json, sys
        import torch
        import torch.distributed as dist
        maps = open("/proc/self/maps").read()
        print(json.dumps({"registered": "torus" in dist.Backend.backend_list,
                          "modules": sorted(m for m in sys.modules if m.startswith("torch_torus")),
                          "libraries": sorted({line.split()[-1] for line in maps.splitlines() if "torch_torus" in line})}))
    """))
    assert state == {"registered": True, "modules": ["torch_torus_autoload"], "libraries": []}


@installed
def test_two_ranks_create_a_torus_group_without_importing_torch_torus(tmp_path):
    results = run_ranks("""
        import json, sys
        import torch
        import torch.distributed as dist
        rank, size, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
        before = "torch_torus" in sys.modules
        dist.init_process_group("torus", init_method="file://" + store, rank=rank, world_size=size)
        tensor = torch.full((5,), float(rank + 1))
        dist.all_reduce(tensor)
        import torch_torus
        print(json.dumps({"before": before, "sum": tensor.tolist(), "backend": torch_torus.backend_of(),
                          "class": type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__}))
        dist.destroy_process_group()
    """, 2, tmp_path)
    for result in results:
        assert result == {"before": False, "sum": [3.0] * 5, "backend": "torus", "class": "ProcessGroupTorus"}


@installed
def test_device_mapped_names_take_torus_without_importing_it(tmp_path):
    (result,) = run_ranks("""
        import json, sys
        import torch
        import torch.distributed as dist
        rank, size, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
        dist.init_process_group("cpu:torus,cuda:gloo", init_method="file://" + store, rank=rank, world_size=size)
        import torch_torus
        print(json.dumps([torch_torus.backend_of(), torch_torus.backend_of(device="cpu"), dist.get_backend()]))
        dist.destroy_process_group()
    """, 1, tmp_path)
    assert result == ["cpu:torus,cuda:gloo", "torus", "cpu:torus,cuda:gloo"]


@installed
def test_the_lazy_registration_is_the_one_import_torch_torus_makes():
    """The name registered at `import torch` has the devices, type and extended API that
    `import torch_torus` registers; only the creator differs (it becomes torch_torus's own)."""
    before, after = last_json(python("""
        import json
        import torch
        import torch.distributed as dist

        def registration():
            plugin = dist.Backend._plugins["TORUS"]
            return {"listed": "torus" in dist.Backend.backend_list, "devices": dist.Backend.backend_capability["torus"],
                    "type": str(dist.Backend.backend_type_map["torus"]), "extended_api": plugin.extended_api,
                    "default_map": dist.Backend.default_device_backend_map, "attribute": dist.Backend.TORUS,
                    "creator": plugin.creator_fn.__module__}

        before = registration()
        import torch_torus
        print(json.dumps([before, registration()]))
    """))
    assert before.pop("creator") == "torch_torus_autoload" and after.pop("creator") == "torch_torus"
    assert before == after
    assert after["devices"] == ["cpu", "cuda"] and after["extended_api"] and after["attribute"] == "torus"


@installed
def test_autoload_off_leaves_torus_unregistered_until_imported():
    state = last_json(python("""
        import json, sys
        import torch
        import torch.distributed as dist
        off = "torus" in dist.Backend.backend_list
        import torch_torus
        print(json.dumps([off, "torch_torus_autoload" in sys.modules, "torus" in dist.Backend.backend_list]))
    """, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}))
    assert state == [False, True, True]


@pytest.mark.parametrize("warnings_as_errors", [False, True], ids=["warning", "python -W error"])
@installed
def test_a_failed_registration_warns_naming_torus_and_torch_still_imports(warnings_as_errors):
    result = python(("import warnings; warnings.simplefilter('error')\n" if warnings_as_errors else "") + """
import json
import torch_torus_autoload

def fails(creator):
    raise RuntimeError("simulated failure")

torch_torus_autoload.register_backend = fails
import torch
import torch.distributed as dist
print(json.dumps([torch.ones(2).sum().item(), "torus" in dist.Backend.backend_list]))
""")
    assert last_json(result) == [2.0, False]
    assert "the backend 'torus' was not registered at `import torch`" in result.stderr
    assert "RuntimeError: simulated failure" in result.stderr


@installed
def test_register_by_name_as_a_setup_hook_registers_torus():
    """Ray's worker_process_setup_hook="torch_torus.register" imports the module and calls it."""
    state = last_json(python("""
        import importlib, json
        import torch.distributed as dist
        module, _, name = "torch_torus.register".rpartition(".")
        getattr(importlib.import_module(module), name)()
        print(json.dumps(dist.Backend._plugins["TORUS"].creator_fn.__module__))
    """, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}))
    assert state == "torch_torus"


def test_backend_of_names_what_each_group_runs_on(tmp_path):
    results = run_ranks("""
        import json, sys
        import torch
        import torch.distributed as dist
        import torch_torus
        rank, size, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
        errors = []
        try:
            torch_torus.backend_of()
        except RuntimeError as error:
            errors.append(str(error))
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=size)
        torus = dist.new_group(backend="torus")
        mapped = dist.new_group(backend="cpu:torus,cuda:gloo")
        only_rank_0 = dist.new_group([0], backend="torus")
        answers = [torch_torus.backend_of(), torch_torus.backend_of(torus), torch_torus.backend_of(mapped),
                   torch_torus.backend_of(mapped, device="cuda")]
        try:
            torch_torus.backend_of(torus, device="xla")
        except ValueError as error:
            errors.append(str(error))
        if rank == 1:
            try:
                torch_torus.backend_of(only_rank_0)
            except ValueError as error:
                errors.append(str(error))
        print(json.dumps({"answers": answers, "errors": errors}))
        dist.destroy_process_group()
    """, 2, tmp_path)
    for rank, result in enumerate(results):
        assert result["answers"] == ["gloo", "torus", "cpu:torus,cuda:gloo", "gloo"]
        assert "no process group" in result["errors"][0]
        assert "no device type 'xla'" in result["errors"][1]
        assert len(result["errors"]) == 2 + rank
        if rank == 1:
            assert "not a member" in result["errors"][2]
