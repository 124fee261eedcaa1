"""Collectives run on the calling thread: a call its caller waits for at once (async_op=False) up
to TORUS_INLINE_BYTES, when none of the group's collectives is queued or running, and
torch.ops.torus.all_reduce_ (no ProcessGroup dispatch, no Work). Issue order with queued work
holds either way; the op reduces as all_reduce does (every dtype and op, against the reference),
traces under torch.compile, and names what is wrong with its arguments."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import harness
from reference import DTYPE_NAMES, allreduce_contract, check_reduction, first_line, gen_all, shapes_for



def torus_only(backend):
    if not backend.startswith("torus"):
        pytest.skip("torus's calling-thread path and torch.ops.torus (TORUS_TEST_BACKENDS runs other backends)")


OP_NAMES = {"SUM": "sum", "AVG": "avg", "PRODUCT": "product", "MIN": "min", "MAX": "max", "BAND": "band",
            "BOR": "bor", "BXOR": "bxor"}


def _case_sync_call_completes_here(ctx, inline_bytes):
    """A sync call (opts.asyncOp False) under the threshold returns a completed Work; above it,
    or with asyncOp True, the Work comes from the worker and is right once waited for. No
    threshold (the default, max): a sync call of 4 MiB returns completed too."""
    from torch.distributed.distributed_c10d import _get_default_group

    problems = []
    group = _get_default_group()
    above = (4 << 20) // 4 + 1 if inline_bytes is None else inline_bytes // 4 + 1
    inline_bytes = 1 << 64 if inline_bytes is None else inline_bytes
    for numel, async_op in ((1000, False), (above, False), (1000, True)):
        inputs = gen_all(("inline", numel, async_op), ctx.world_size, (numel,), "float32")
        t = inputs[ctx.rank].clone()
        opts = dist.AllreduceOptions()
        opts.asyncOp = async_op
        work = group.allreduce([t], opts)
        completed_at_return = work.is_completed()
        work.wait()
        label = f"{numel} floats, asyncOp={async_op}"
        problems += check_reduction(t, inputs, "SUM", label)
        if numel * 4 <= inline_bytes and not async_op and not completed_at_return:
            problems.append(f"{label}: the Work was not completed when allreduce returned (it should "
                            f"run on the calling thread)")
    return problems


@pytest.mark.parametrize("world_size", [1, 2, 4], ids=lambda w: f"ws{w}")
def test_sync_call_runs_on_the_calling_thread(backend, world_size):
    torus_only(backend)
    harness.check(backend, world_size, _case_sync_call_completes_here, 65536,
                  env={"TORUS_INLINE_BYTES": "64K"})


@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_sync_call_of_any_size_runs_on_the_calling_thread_by_default(backend, world_size):
    torus_only(backend)
    harness.check(backend, world_size, _case_sync_call_completes_here, None)


def _case_order_with_queued_work(ctx, use_op):
    """Async calls queued on the worker, then a sync call (or the op) that must not overtake
    them; then the same with another thread issuing async work on a second group meanwhile."""
    problems = []
    big = [gen_all(("queued", i), ctx.world_size, (300_000 + i,), "float32") for i in range(4)]
    tensors = [inputs[ctx.rank].clone() for inputs in big]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    small_inputs = gen_all(("after", use_op), ctx.world_size, (33,), "int64")
    small = small_inputs[ctx.rank].clone()
    if use_op:
        torch.ops.torus.all_reduce_(small, dist.group.WORLD.group_name, "max")
    else:
        dist.all_reduce(small, op=dist.ReduceOp.MAX)
    problems += check_reduction(small, small_inputs, "MAX", "the call issued behind queued work")
    for i, (work, t) in enumerate(zip(works, tensors)):
        work.wait()
        problems += check_reduction(t, big[i], "SUM", f"queued async call #{i}")
    # The sequence numbers agree: every rank's next collective matches.
    t = torch.ones(3)
    dist.all_reduce(t)
    if not bool((t == ctx.world_size).all()):
        problems.append(f"the next collective gave {t.tolist()}")
    return problems


@pytest.mark.parametrize("use_op", [False, True], ids=["all_reduce", "op"])
def test_issue_order_holds_with_queued_work(backend, use_op):
    torus_only(backend)
    harness.check(backend, 3, _case_order_with_queued_work, use_op)


def _case_op(ctx, dtype):
    problems = []
    name = dist.group.WORLD.group_name
    for op, op_name in OP_NAMES.items():
        contract = allreduce_contract(op, dtype)
        for shape in shapes_for(ctx.world_size)[:3]:
            shape = tuple(shape)
            inputs = gen_all(("op", dtype, op, shape), ctx.world_size, shape, dtype, op)
            t = inputs[ctx.rank].clone()
            label = f"torch.ops.torus.all_reduce_({dtype}, {op_name}) shape={shape}"
            try:
                torch.ops.torus.all_reduce_(t, name, op_name)
            except Exception as error:
                if contract != "error":
                    problems.append(f"{label}: raised {first_line(error)}")
                continue
            if contract == "error":
                problems.append(f"{label}: should raise (torch's all_reduce refuses the pair)")
                continue
            problems += check_reduction(t, inputs, op, label)
    return problems


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda w: f"ws{w}")
def test_op_reduces_as_all_reduce(backend, world_size, dtype):
    torus_only(backend)
    harness.check(backend, world_size, _case_op, dtype)


def _case_op_compiled(ctx):
    name = dist.group.WORLD.group_name

    def step(x):
        y = x * 2
        torch.ops.torus.all_reduce_(y, name, "sum")
        return y + 1

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    x = torch.full((16,), float(ctx.rank + 1))
    out = compiled(x)
    expected = 2 * sum(range(1, ctx.world_size + 1)) + 1
    return [] if bool((out == expected).all()) else [f"compiled step gave {out[:4].tolist()}, expected {expected}"]


def test_op_traces_under_torch_compile(backend):
    torus_only(backend)
    harness.check(backend, 2, _case_op_compiled, timeout=180)


def _case_op_errors(ctx):
    problems = []
    name = dist.group.WORLD.group_name
    for args, words in (((torch.ones(2), "no-such-group"), ["no-such-group", "group_name"]),
                        ((torch.ones(2), name, "mean"), ["mean", "reduce_op"]),
                        ((torch.ones(4).to_sparse(), name), ["SparseCPU"])):
        try:
            torch.ops.torus.all_reduce_(*args)
        except Exception as error:
            text = str(error)
            if not any(word in text for word in words):
                problems.append(f"all_reduce_{args[1:]}: the error names none of {words}: {first_line(error)}")
        else:
            problems.append(f"all_reduce_{args[1:]}: did not raise")
    t = torch.ones(5)
    torch.ops.torus.all_reduce_(t, name)
    if not bool((t == ctx.world_size).all()):
        problems.append(f"the group after the rejected calls gave {t.tolist()}")
    return problems


def test_op_errors_name_the_argument(backend):
    torus_only(backend)
    harness.check(backend, 2, _case_op_errors)
