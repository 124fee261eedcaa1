"""What only the OFI transport has (the collective, point-to-point, fault, flow-control and
timeout suites run over it as over every transport: TRANSPORT_CONTRACT in those modules):

* large messages by RMA reads (TORUS_OFI_RMA_BYTES set: libfabric's tcp provider streams by
  default), collectives and point-to-point, against the one-process reference;
* the hybrid form shm+ofi (shared memory inside each host, OFI between: two ranks per host here);
* the startup log naming the provider, and a provider that does not exist named in the error;
* libfabric's shm provider.

Skips, saying why, in a build without libfabric.
"""

import re

import pytest
import torch_torus

import harness
from reference import check_reduction, gen_all

if harness.without_ofi():
    pytest.skip(harness.without_ofi(), allow_module_level=True)

OFI = "torus+ofi"
RMA = {"TORUS_OFI_PROVIDER": "tcp", "TORUS_OFI_RMA_BYTES": "64K"}
# Sizes (elements) around the RMA threshold and the stream's 16 KiB chunks.
COUNTS = [1, 4095, 16385, 65537, 1 << 20, 3_000_001]


def _case_allreduce(ctx, algorithm):
    import torch
    import torch.distributed as dist

    problems = []
    group = ctx.new_group(list(range(ctx.world_size)), pg_options=torch_torus.Options(allreduce=algorithm))
    for count in COUNTS:
        inputs = gen_all(("ofi", algorithm, count), ctx.world_size, (count,), "float32", "SUM")
        out = inputs[ctx.rank].clone()
        dist.all_reduce(out, group=group)
        problems += check_reduction(out, inputs, "SUM", f"{algorithm} {count}")
    dist.destroy_process_group(group)
    return problems


@pytest.mark.parametrize("algorithm", ["ring", "direct", "rabenseifner"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_allreduce_by_rma_reads(world_size, algorithm):
    harness.check(OFI, world_size, _case_allreduce, algorithm, env=RMA, timeout=120)


def _case_point_to_point(ctx):
    """Every rank sends rank+1 messages of each size around the threshold to the next rank, with
    tags out of order, and receives from the previous; each payload says who sent it."""
    import torch
    import torch.distributed as dist

    n, problems = ctx.world_size, []
    to, frm = (ctx.rank + 1) % n, (ctx.rank - 1) % n
    sizes = [100, 70_000, 300_000, 2_000_000]
    sends = [dist.isend(torch.full((size,), float(ctx.rank * 10 + i)), to, tag=len(sizes) - i)
             for i, size in enumerate(sizes)]
    for i, size in reversed(list(enumerate(sizes))):
        got = torch.zeros(size)
        dist.recv(got, frm, tag=len(sizes) - i)
        if not bool((got == float(frm * 10 + i)).all()):
            problems.append(f"message {i} ({size} floats) from rank {frm}: {got[:3].tolist()}...")
    for work in sends:
        work.wait()
    return problems


@pytest.mark.parametrize("world_size", [2, 4])
def test_point_to_point_by_rma_reads(world_size):
    harness.check(OFI, world_size, _case_point_to_point, env=RMA, timeout=120)


def _case_hybrid(ctx):
    import torch
    import torch.distributed as dist

    problems = []
    for count in (7, 70_000, 1_000_001):
        inputs = gen_all(("hybrid", count), ctx.world_size, (count,), "float32", "SUM")
        out = inputs[ctx.rank].clone()
        dist.all_reduce(out)
        problems += check_reduction(out, inputs, "SUM", f"shm+ofi {count}")
    peer = ctx.rank ^ 1  # the other rank of this host: point-to-point goes by OFI all the same
    got = torch.zeros(5000)
    works = [dist.isend(torch.full((5000,), float(ctx.rank)), peer), dist.irecv(got, peer)]
    for work in works:
        work.wait()
    if not bool((got == float(peer)).all()):
        problems.append(f"point-to-point from rank {peer}: {got[:3].tolist()}")
    return problems


def test_shared_memory_inside_hosts_ofi_between():
    harness.check("torus+shm+ofi", 4, _case_hybrid, env={"TORUS_HOST_ID": "", "TORUS_OFI_PROVIDER": "tcp"},
                  options={"host_id": "host-{rank_pair}"}, timeout=120)


def _case_startup(ctx):
    """What group creation logs at TORUS_LOG_LEVEL=info (the C++ core writes to fd 2)."""
    import datetime
    import os
    import sys
    import tempfile

    import torch.distributed as dist

    os.environ["TORUS_LOG_LEVEL"] = "info"
    with tempfile.TemporaryFile() as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            ctx.init_process_group(init="file", timeout=datetime.timedelta(seconds=30))
            dist.barrier()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        dist.destroy_process_group()
        log.seek(0)
        return log.read().decode(errors="replace")


def _case_bad_provider(ctx):
    import datetime
    import os

    os.environ["TORUS_OFI_PROVIDER"] = "no_such_provider"
    try:
        ctx.init_process_group(init="file", timeout=datetime.timedelta(seconds=20))
    except Exception as e:  # noqa: BLE001 - the text is what is checked
        return str(e)
    return "created"


def test_a_provider_that_does_not_exist_is_named():
    results = harness.run_job(OFI, 2, _case_bad_provider, timeout=60)
    for text in results:
        assert "no_such_provider" in text and "TORUS_OFI_PROVIDER" in text and "fi_info" in text, text


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_each_provider_runs_and_is_named(provider):
    harness.check(OFI, 2, _case_allreduce, "ring", env={"TORUS_OFI_PROVIDER": provider}, timeout=120)
    logs = harness.run_job(OFI, 2, _case_startup, env={"TORUS_OFI_PROVIDER": provider}, timeout=60)
    assert f"over ofi: {provider}" in logs[0], logs[0]
    # Which libfabric: the process may hold another than the build's (an MPI's, loaded first).
    assert re.search(r"libfabric \d+\.\d+\)", logs[0]), logs[0]
    # The ranks share a host but not memory (the transport is ofi alone): the log says what runs
    # in place of the barrier over shared memory, and why.
    assert "barrier shared_memory runs as dissemination (no shared_memory)" in logs[0], logs[0]
