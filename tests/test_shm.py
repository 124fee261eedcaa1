"""The shared-memory transport's own promises: nothing left in /dev/shm, the transport chosen
from where ranks live, the shm-only allreduces refusing what they cannot do, and mismatched calls
named on both sides (a killed peer, in each shm allreduce too: test_faults.py). Shared memory as
a Comm's capability: the shm algorithms on Comms over some ranks of a group (the ranks of one
host over shm+tcp, Comms of one host interleaved in any order; torus_testing's SubsetComms, built
by tests/torus_testing.py), and the torus's row phases on shared memory, against references.

(Every collective also runs over shm and tcp alike: conftest's backend parameter.)"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist

import harness
import torus_testing
from reference import first_line, gen

SHM = "torus+shm"


def _shm_entries() -> set:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _case_nothing_in_dev_shm(ctx):
    before = _shm_entries()
    group = ctx.new_group(list(range(ctx.world_size)))
    t = torch.ones(1000)
    dist.all_reduce(t, group=group)
    during = _shm_entries()
    dist.destroy_process_group(group)
    problems = [] if t.eq(ctx.world_size).all() else [f"wrong sum {t[:4].tolist()}"]
    if during - before:
        problems.append(f"/dev/shm gained {sorted(during - before)} while a shm group was alive")
    return problems


def test_segments_have_no_name_in_dev_shm():
    harness.check(SHM, 4, _case_nothing_in_dev_shm)


def _case_transport_is_shm_on_one_host(ctx):
    import torch_torus

    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    # 64 KiB fits a one-shot slot on shm; over tcp one_shot is not available and falls back.
    got = torch_torus.algorithm_for("allreduce", 1 << 16, dist.group.WORLD)
    return [] if (got == "one_shot") == (ctx.env.get("TORUS_TRANSPORT") != "tcp") else [
        f"TORUS_TRANSPORT={ctx.env.get('TORUS_TRANSPORT')!r}: one_shot chosen as {got!r} ({backend})"]


@pytest.mark.parametrize("transport", ["auto", "shm", "tcp"])
def test_transport_setting_decides_shared_memory_algorithms(transport):
    harness.check("torus", 2, _case_transport_is_shm_on_one_host,
                  env={"TORUS_TRANSPORT": transport, "TORUS_ALLREDUCE": "one_shot"})


def _case_shm_across_hosts_rejected(ctx):
    import torch_torus

    try:
        ctx.new_group(list(range(ctx.world_size)),
                      pg_options=torch_torus.Options(transport="shm", host_id=f"host{ctx.rank}"))
    except Exception as e:
        text = str(e)
        return [] if "TORUS_TRANSPORT" in text and "hosts" in text else [f"unclear error: {first_line(e)}"]
    return ["TORUS_TRANSPORT=shm across two hosts was accepted"]


def test_shm_across_hosts_is_a_config_error():
    harness.check("torus", 2, _case_shm_across_hosts_rejected)


def _case_one_shot_too_large_falls_back(ctx):
    import torch_torus

    group = ctx.new_group(list(range(ctx.world_size)), pg_options=torch_torus.Options(allreduce="one_shot"))
    problems = []
    for nbytes, expected in ((512 * 1024, "one_shot"), (512 * 1024 + 4, "two_shot")):
        got = torch_torus.algorithm_for("allreduce", nbytes, group)
        if got != expected:
            problems.append(f"{nbytes} bytes: {got}, expected {expected}")
    t = torch.full((300_000,), float(ctx.rank + 1))
    dist.all_reduce(t, group=group)
    expected_sum = ctx.world_size * (ctx.world_size + 1) / 2
    if not t.eq(expected_sum).all():
        problems.append(f"fallback allreduce wrong: {t[:4].tolist()}")
    dist.destroy_process_group(group)
    return problems


def test_one_shot_above_its_slot_runs_two_shot():
    harness.check(SHM, 3, _case_one_shot_too_large_falls_back)


def _case_mismatch_named(ctx, algorithm):
    import torch_torus

    group = ctx.new_group(list(range(ctx.world_size)),
                          pg_options=torch_torus.Options(allreduce=algorithm))
    t = torch.ones(1000 + ctx.rank)
    try:
        dist.all_reduce(t, group=group)
    except Exception as e:
        text = str(e)
        want = ["rank 0", "rank 1", "4000 bytes", "4004 bytes"]
        missing = [w for w in want if w not in text]
        if missing or not isinstance(e, dist.DistBackendError):
            return [f"{type(e).__name__} lacks {missing}: {first_line(e)}"]
        return []
    return [f"mismatched sizes were not detected: {t[:4].tolist()}"]


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_mismatched_sizes_name_both_sides(algorithm):
    results = harness.run_job(SHM, 2, _case_mismatch_named, algorithm, init="file")
    harness.conclude(harness.problems(results), None, f"{SHM} mismatch")


# ------------------------------------------------------------------------------ waiting


@pytest.mark.parametrize("policy, ranks, cores, own, caller, peer_here, others, look", [
    # auto pauses only on the caller's thread, with a core per rank and no peer on this core.
    ("auto", 1, 1, 1, True, False, 0, "pause"),
    ("auto", 2, 2, 2, True, False, 0, "pause"),
    ("auto", 2, 16, 16, True, False, 3, "pause"),
    ("auto", 3, 2, 2, True, False, 0, "yield"),
    ("auto", 8, 2, 2, True, False, 0, "yield"),
    ("auto", 2, 2, 2, False, False, 0, "yield"),
    ("auto", 8, 2, 2, False, False, 0, "yield"),
    # A peer that last waited on this core runs once this thread leaves it.
    ("auto", 2, 2, 2, True, True, 0, "sleep"),
    ("auto", 2, 2, 2, False, True, 0, "yield"),
    # Unbound ranks: a second thread of the process in a caller's collective outnumbers its share
    # of one core (when it is not waiting, it computes on the core a pause would hold).
    ("auto", 2, 2, 2, True, False, 1, "yield"),
    ("auto", 2, 4, 4, True, False, 1, "pause"),
    # Bound ranks (one core each): the share's one thread pauses, the next yields.
    ("auto", 2, 2, 1, True, False, 0, "pause"),
    ("auto", 2, 2, 1, True, False, 1, "yield"),
    # pause and yield do as they say, on any thread.
    ("pause", 8, 2, 2, False, True, 0, "pause"),
    ("yield", 1, 1, 1, True, False, 0, "yield")])
def test_a_wait_decides_from_what_holds_now(testing_module, policy, ranks, cores, own, caller, peer_here, others,
                                            look):
    """SpinWait's first look for a shm wait (TORUS_WAIT; csrc/transport/spin_wait.h)."""
    assert testing_module.spin_wait_first_look(policy, ranks, cores, own, caller, peer_here, others) == look


def test_a_pause_that_finds_nothing_ends_in_sleep(testing_module):
    assert testing_module.spin_wait_pause_ends()


def test_calling_thread_scopes_nest(testing_module):
    assert testing_module.spin_wait_scopes() == [False, True, True, True, False]


def test_usable_cores_follow_the_affinity_mask(testing_module):
    """The cores a rank counts are its affinity mask's, as a launcher's binding sets it."""
    mask = os.sched_getaffinity(0)
    assert testing_module.usable_cores() == len(mask)
    try:
        os.sched_setaffinity(0, {max(mask)})
        assert testing_module.usable_cores() == 1
    finally:
        os.sched_setaffinity(0, mask)


# ------------------------------------------------------------------------------ subset Comms


@pytest.fixture(scope="module")
def testing_module():
    """The test-only module, built here before any rank needs it (tests/torus_testing.py)."""
    return torus_testing.module()


def _subset_comms(ctx, hosts):
    """A shm+tcp group of its own over the pool's ranks (hosts[r]: rank r's host)."""
    ctx.state["subset_groups"] = ctx.state.get("subset_groups", 0) + 1
    store = dist.PrefixStore(f"subset-comms-{ctx.state['subset_groups']}", dist.distributed_c10d._get_default_store())
    return torus_testing.module().SubsetComms(ctx.rank, ctx.world_size, hosts, store.set, store.get)


def _blocks(count, n):
    """evenBlocks: (offset, count) of each of n blocks."""
    base, larger = divmod(count, n)
    sizes = [base + (i < larger) for i in range(n)]
    return [(sum(sizes[:i]), sizes[i]) for i in range(n)]


def _run_subset(comms, algorithm, ranks, count, key, rank):
    """Runs `algorithm` on the Comm over `ranks` with exact float64 inputs; [] or what is wrong."""
    inputs = {r: gen((key, count), r, (count,), "int32").double() for r in ranks}
    t = inputs[rank].clone()
    getattr(comms, algorithm)(ranks, t)
    me = ranks.index(rank)
    total = sum(inputs.values())
    if algorithm.endswith("allreduce"):
        expected, got = total, t
    else:
        offset, size = _blocks(count, len(ranks))[me]
        if algorithm == "single_copy_reduce_scatter":
            expected, got = total[offset:offset + size], t[offset:offset + size]
        else:
            expected = torch.cat([inputs[r][o:o + c] for r, (o, c) in zip(ranks, _blocks(count, len(ranks)))])
            got = t
    return [] if torch.equal(got, expected) else [f"{algorithm} on ranks {ranks}, {count} elements: wrong"]


SUBSET_ALGORITHMS = ["one_shot_allreduce", "two_shot_allreduce", "single_copy_reduce_scatter",
                     "single_copy_allgather"]


def _case_one_host_inside_a_group(ctx):
    # Ranks 0-2 on one host, rank 3 on another: only Comms inside the first host share memory.
    comms = _subset_comms(ctx, [0, 0, 0, 1])
    problems = []
    for ranks, expected in (([0, 1, 2, 3], False), ([2, 0, 1], True), ([0, 1], True), ([2, 3], False),
                            ([3], True)):
        if ctx.rank in ranks and comms.shares_memory(ranks) != expected:
            problems.append(f"ranks {ranks} share memory: {not expected}, expected {expected}")
    if ctx.rank == 3:
        return problems + _run_subset(comms, "one_shot_allreduce", [3], 1000, "alone", 3)
    # Comm ranks in another order than the group's: postings, slots and peers are translated.
    for ranks in ([2, 0, 1], [1, 2]):
        if ctx.rank not in ranks:
            continue
        for algorithm in SUBSET_ALGORITHMS:
            for count in (1, 1000, 60_001 if algorithm.startswith("one_shot") else 300_001):
                problems += _run_subset(comms, algorithm, ranks, count, ("host", algorithm), ctx.rank)
    return problems


@pytest.mark.usefixtures("testing_module")
def test_shm_algorithms_on_the_ranks_of_one_host_over_shm_and_tcp():
    harness.check("torus+tcp", 4, _case_one_host_inside_a_group, timeout=120)


def _case_interleaved_subsets(ctx, steps, seed):
    # Comms of one host that share some ranks and not others, in an order every rank knows:
    # each rank runs the steps it is in. Ranks run different numbers of shm collectives and meet
    # each peer in different ones, so epochs and slots must be counted per pair of ranks.
    comms = _subset_comms(ctx, [0] * ctx.world_size)
    chooser = random.Random(seed)
    problems = []
    for step in range(steps):
        ranks = chooser.sample(range(ctx.world_size), chooser.randint(2, ctx.world_size))
        algorithm = chooser.choice(SUBSET_ALGORITHMS)
        count = chooser.choice([1, 33, 4096, 50_001])
        if ctx.rank in ranks:
            problems += _run_subset(comms, algorithm, ranks, count, ("interleaved", step), ctx.rank)
    return problems


@pytest.mark.usefixtures("testing_module")
def test_shm_algorithms_on_interleaved_comms_of_one_host():
    harness.check("torus+tcp", 4, _case_interleaved_subsets, 60, 14, timeout=180)


def _case_subset_mismatch(ctx):
    comms = _subset_comms(ctx, [0, 0, 1, 1])
    if ctx.rank >= 2:
        return []
    try:
        comms.one_shot_allreduce([0, 1], torch.ones(1000 + ctx.rank, dtype=torch.float64))
    except RuntimeError as e:
        text = str(e)
        return [] if "8000" in text and "8008" in text else [f"unclear mismatch: {first_line(e)}"]
    return ["mismatched sizes on a subset Comm were not detected"]


@pytest.mark.usefixtures("testing_module")
def test_mismatch_on_a_subset_comm_is_named():
    harness.check("torus+tcp", 4, _case_subset_mismatch)


# ------------------------------------------------------------------------------ torus rows


def _case_torus_rows_on_shared_memory(ctx, ranks_per_host, dims):
    import torch_torus

    # Small sizes go by one_shot on the whole group (shm only) and the rest by the torus, so the
    # group's shm collectives interleave with its rows'; the small chunk makes many segments.
    options = dict(host_id=f"host-{ctx.rank // ranks_per_host}", transport="auto",
                   allreduce="one_shot:0-4096;torus:4097-max", torus_dims=dims, chunk_bytes=4096)
    group = ctx.new_group(list(range(ctx.world_size)), pg_options=torch_torus.Options(**options))
    problems = []
    for repeat in range(2):
        for count in (1, 7, 1000, 300_001):
            inputs = [gen(("rows", repeat, count), r, (count,), "int32").double() for r in range(ctx.world_size)]
            t = inputs[ctx.rank].clone()
            dist.all_reduce(t, group=group)
            if not torch.equal(t, sum(inputs)):
                problems.append(f"{dims} torus, {count} doubles: wrong")
    dist.destroy_process_group(group)
    return problems


@pytest.mark.parametrize("world_size,ranks_per_host,dims", [
    (8, 8, "2x4"),  # two rows of one host, and columns on it too
    (8, 4, "2x4"),  # a row per host, over shm+tcp
    (8, 4, "4x2"),  # two rows per host, columns across hosts
])
def test_torus_rows_on_shared_memory(world_size, ranks_per_host, dims):
    harness.check("torus+tcp", world_size, _case_torus_rows_on_shared_memory, ranks_per_host, dims, timeout=180)


def _huge_page_kib(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _kernel_collapses() -> bool:
    """Whether this kernel moves memory onto huge pages on request (madvise MADV_COLLAPSE)."""
    import ctypes
    import mmap

    region = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # like a tensor's memory
    region.write(b"x" * len(region))
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    begin = (address + (2 << 20) - 1) & ~((2 << 20) - 1)  # one whole huge page inside
    return ctypes.CDLL(None).madvise(ctypes.c_void_p(begin), ctypes.c_size_t(2 << 20), 25) == 0


def _case_reused_buffer_on_huge_pages(ctx):
    import torch_torus

    group = ctx.new_group(list(range(ctx.world_size)), pg_options=torch_torus.Options(allreduce="two_shot"))
    t = torch.full((3 << 20,), float(ctx.rank + 1))  # 12 MiB: at least 4 whole huge pages inside
    before = _huge_page_kib(t.data_ptr())
    problems = []
    dist.all_reduce(t, group=group)
    if _huge_page_kib(t.data_ptr()) != before:
        problems.append("a buffer posted once was moved onto huge pages")
    dist.all_reduce(t, group=group)
    dist.all_reduce(t, group=group)
    after = _huge_page_kib(t.data_ptr())
    if after - before < 8 << 10:
        problems.append(f"a buffer posted three times has {after} KiB on huge pages, {before} before")
    n = ctx.world_size
    if not t.eq(n * n * n * (n + 1) / 2).all():
        problems.append(f"wrong sums {t[:4].tolist()}, {t[-4:].tolist()}")
    dist.destroy_process_group(group)
    return problems


def test_a_buffer_posted_again_is_moved_onto_huge_pages():
    """Peers pin every page of a buffer they copy from or into; on 2 MiB pages that costs far less
    (HugePageBacking). A buffer is moved the second time it is posted, one posted once is not."""
    if not _kernel_collapses():
        pytest.skip("this kernel does not move memory onto huge pages on request (MADV_COLLAPSE, Linux >= 6.1)")
    harness.check(SHM, 3, _case_reused_buffer_on_huge_pages)


def _case_large_uneven_blocks(ctx):
    import torch_torus

    group = ctx.new_group(list(range(ctx.world_size)), pg_options=torch_torus.Options(allreduce="two_shot"))
    problems = []
    # Blocks of about 1.4 MiB (chunked smaller than a small block) whose last chunk is partial.
    count = (1 << 20) + 12345
    for dtype in (torch.float32, torch.float64):
        t = torch.arange(count, dtype=dtype) * (ctx.rank + 1)
        dist.all_reduce(t, group=group)
        n = ctx.world_size
        expected = torch.arange(count, dtype=dtype) * (n * (n + 1) // 2)
        if not torch.equal(t, expected):
            wrong = (t != expected).nonzero()
            problems.append(f"{dtype}: {wrong.numel()} elements wrong, first at {wrong[0].item()}")
    dist.destroy_process_group(group)
    return problems


def test_two_shot_reduces_large_blocks_chunk_by_chunk():
    """A block of 1 MiB or more is reduced in smaller chunks than a small one
    (single_copy_reduce_scatter): every element lands where it belongs, the partial last chunk too."""
    harness.check(SHM, 3, _case_large_uneven_blocks)
