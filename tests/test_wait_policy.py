"""TORUS_WAIT: how waits on shared memory spend their looks (csrc/transport/spin_wait.h). Every
policy computes what the others do, with several threads calling on groups of their own (the
process's count of pausing threads shared between them), with ranks that outnumber the cores, and
while a rank's affinity changes under a running group; a wrong name fails naming the variable.
How fast each policy is belongs to benchmarks/busy_host.py, never to a test."""

from __future__ import annotations

import os
import threading

import pytest
import torch.distributed as dist

import harness
from reference import check_reduction, gen_all
from torch_torus import _C, config

POLICIES = _C.WAIT_POLICIES


def torus_only(backend):
    if not backend.startswith("torus"):
        pytest.skip("TORUS_WAIT is torus's (TORUS_TEST_BACKENDS runs other backends)")


def test_the_policies_are_declared_in_cpp_and_auto_is_the_default():
    assert POLICIES[0] == "auto" and set(POLICIES) == {"auto", "pause", "yield"}
    assert config.resolve()["wait"] == "auto"
    assert config.resolve(environ={"TORUS_WAIT": "Yield"})["wait"] == "yield"


@pytest.mark.parametrize("value", ["spin", "", "pause,yield"])
def test_a_policy_of_another_name_fails_naming_the_variable(value):
    with pytest.raises(config.ConfigError, match=r"TORUS_WAIT=.*auto, pause, yield"):
        config.resolve(environ={"TORUS_WAIT": value})


def _case_threads_on_groups(ctx, policy, threads, move_affinity):
    """`threads` threads per rank, each on a torus group of its own with TORUS_WAIT=policy, run
    small and larger all_reduces against the reference; with move_affinity, rank 0 narrows its
    affinity to one core midway (its transport re-reads it within SpinWait::kCoresPeriod) and
    widens it again."""
    import torch_torus

    groups = [ctx.new_group(list(range(ctx.world_size)), pg_options=torch_torus.Options(wait=policy))
              for _ in range(threads)]
    problems = []
    lock = threading.Lock()
    cores = os.sched_getaffinity(0)

    def calls(index: int) -> None:
        found = []
        try:
            for step in range(40):
                numel = (1024, 70_000)[step % 2]
                inputs = gen_all(("wait", policy, index, step), ctx.world_size, (numel,), "float32")
                tensor = inputs[ctx.rank].clone()
                dist.all_reduce(tensor, group=groups[index])
                found += check_reduction(tensor, inputs, "SUM", f"thread {index} step {step}")
                if move_affinity and ctx.rank == 0 and index == 0 and step in (10, 30):
                    os.sched_setaffinity(0, {min(cores)} if step == 10 else cores)
        except Exception as error:  # the rank reports it; a thread's exception would be lost
            found.append(f"thread {index}: {type(error).__name__}: {error}")
        with lock:
            problems.extend(found)

    workers = [threading.Thread(target=calls, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    os.sched_setaffinity(0, cores)
    for group in groups:
        dist.destroy_process_group(group)
    return problems


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("world_size,threads", [(2, 1), (2, 2), (4, 2)], ids=lambda v: str(v))
def test_every_policy_computes_the_reference(backend, policy, world_size, threads):
    torus_only(backend)
    harness.check(backend, world_size, _case_threads_on_groups, policy, threads, False)


@pytest.mark.parametrize("policy", ["auto"])
def test_a_rank_whose_affinity_changes_under_a_running_group(backend, policy):
    torus_only(backend)
    harness.check(backend, 2, _case_threads_on_groups, policy, 2, True)


def _case_async_and_sync_callers(ctx):
    """The worker thread (async calls) and the calling thread (sync calls) wait at once under
    auto: the worker never pauses, the caller may; both results are right."""
    import torch_torus

    group = ctx.new_group(list(range(ctx.world_size)), pg_options=torch_torus.Options(wait="auto"))
    problems = []
    for step in range(20):
        queued = gen_all(("async", step), ctx.world_size, (200_000,), "float32")
        big = queued[ctx.rank].clone()
        work = dist.all_reduce(big, group=group, async_op=True)
        small_inputs = gen_all(("sync", step), ctx.world_size, (64,), "float64")
        small = small_inputs[ctx.rank].clone()
        dist.all_reduce(small, group=group, op=dist.ReduceOp.MAX)
        work.wait()
        problems += check_reduction(big, queued, "SUM", f"async step {step}")
        problems += check_reduction(small, small_inputs, "MAX", f"sync step {step}")
    dist.destroy_process_group(group)
    return problems


def test_the_worker_and_the_caller_wait_together(backend):
    torus_only(backend)
    harness.check(backend, 2, _case_async_and_sync_callers)

