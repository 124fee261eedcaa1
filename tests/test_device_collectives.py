"""The CUDA path's collectives (csrc/collectives/device/) on this CPU: their logic runs unchanged
against a host DevicePath and host DeviceArenas (tests/native/, built by tests/torus_testing.py: copies
by memcpy, reductions by the CPU reducer, staging in host memory, each rank's arena a POSIX
shared-memory segment mapped by the ranks its `hosts` list puts on its host, over a TCP group).

The host path checks every copy and reduction as it is enqueued: inside the call's buffer, an
arena's half or a staging buffer (a piece that crosses from one half of an arena into the other,
or past a buffer's end, fails at once), never a write into a peer's arena. Its "deferred" mode
runs what is enqueued only at synchronize(), the latest a stream may run it, so an algorithm that
signals or sends before its copies have landed reads stale bytes; "eager" runs each operation at
once, so one that reads a peer's arena before the barrier that makes it ready does.

Routes: all ranks on one host (arenas), every rank its own host (staged ring), mixed hosts with a
torus grid whose rows are the hosts (rows by arenas, columns staged) and without one (staged on
every rank). World sizes 1, 2, 3, 4, 8, run as groups over the first ranks of one pool of 8
workers (the idle ranks return at once), to keep process start-up off the 2-core budget.
Results against tests/reference.py; allreduce results bit for bit alike on every rank."""

from __future__ import annotations

import itertools
import os
import zlib

import pytest
import torch
import torch.distributed as dist

import harness
import torus_testing
from reference import check_reduction, compare, gen, gen_all

BACKEND = "torus+tcp"
POOL = 8
#: a case's bound; each collective's deadline (timeout_s) is shorter, so a hang fails in the
#: collective, naming what it waited for, before the harness kills the pool
CASE_TIMEOUT = 90
CALL_TIMEOUT_S = 30.0

DTYPES = ["float32", "float64", "bfloat16", "int32", "bool"]
OPS = ["SUM", "MAX", "PRODUCT"]
SMALL_ARENA = 4096
_keys = itertools.count()


def _run(size, fn, *args, timeout=CASE_TIMEOUT):
    """fn on a group over the pool's first `size` ranks; their results (the others return None)."""
    results = harness.run(BACKEND, POOL, fn, size, f"{fn.__name__}-{next(_keys)}", *args, timeout=timeout)
    return results[:size]


@pytest.fixture(scope="module", autouse=True)
def testing_module():
    """The test-only module, built here before any rank needs it."""
    return torus_testing.module()


def _make(ctx, size, key, hosts, arena_bytes=1 << 20, mode="eager"):
    store = dist.PrefixStore(f"device-on-host-{key}", dist.distributed_c10d._get_default_store())
    return torus_testing.module().DeviceCollectivesOnHost(ctx.rank, size, hosts, store.set, store.get,
                                                          arena_bytes=arena_bytes, mode=mode,
                                                          timeout_s=CALL_TIMEOUT_S)


def _digest(t):
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def _layout(size, layout):
    """hosts (rank r's host) and the torus grid (rows, or None) of a layout."""
    if layout == "one":
        return [0] * size, None
    if layout == "each":
        return list(range(size)), None
    kind, _, dims = layout.partition(":")
    rows, cols = map(int, dims.split("x"))
    assert rows * cols == size
    grid = [list(range(i * cols, (i + 1) * cols)) for i in range(rows)]
    if kind == "hostrows":  # a host per row (rows by arenas, columns staged)
        return [r // cols for r in range(size)], grid
    if kind == "onegrid":  # the grid on one host: rows and columns by arenas
        return [0] * size, grid
    if kind == "eachgrid":  # every rank its own host: rows and columns staged
        return list(range(size)), grid
    if kind == "hostflat":  # a host per row, no grid: the Comm spans hosts, staged everywhere
        return [r // cols for r in range(size)], None
    raise ValueError(layout)


def _expected_route(size, layout):
    hosts, grid = _layout(size, layout)
    route = "cuda_ipc" if len(set(hosts)) == 1 else "staged"
    if grid is None or len(grid) <= 1 or len(grid[0]) <= 1:
        return route
    row_route = "cuda_ipc" if len({hosts[r] for r in grid[0]}) == 1 else "staged"
    column_route = "cuda_ipc" if len({hosts[row[0]] for row in grid}) == 1 else "staged"
    return f"torus (rows {row_route}, columns {column_route})"


# ------------------------------------------------------------------------------ the host path


def test_host_path_reduce_with_the_destination_among_its_sources():
    """One process: dst = srcs[0] (op) srcs[1] ... where dst is no source, the first, a later one
    or several; a partial overlap is refused. Also a group of one rank, whose collectives return
    the input."""
    store = dist.HashStore()
    dc = torus_testing.module().DeviceCollectivesOnHost(0, 1, [0], store.set, store.get, arena_bytes=4096)
    problems = []
    for dtype, op in (("float32", "SUM"), ("float64", "PRODUCT"), ("int32", "MAX"), ("bool", "SUM"),
                      ("bool", "PRODUCT"), ("bfloat16", "SUM")):
        a, b, c = gen_all(("host_reduce", dtype, op), 3, (37,), dtype, op)
        for name, dst_of, srcs_of in (
                ("dst apart", lambda x, y, z: torch.empty_like(x), lambda d, x, y, z: [x, y, z]),
                ("dst first", lambda x, y, z: x, lambda d, x, y, z: [d, y, z]),
                ("dst second", lambda x, y, z: y, lambda d, x, y, z: [x, d, z]),
                ("dst last", lambda x, y, z: z, lambda d, x, y, z: [x, y, d]),
                ("dst first and last", lambda x, y, z: x, lambda d, x, y, z: [d, y, d]),
        ):
            x, y, z = a.clone(), b.clone(), c.clone()
            dst = dst_of(x, y, z)
            srcs = srcs_of(dst, x, y, z)
            inputs = [s.clone() for s in srcs]
            dc.host_reduce(dst, srcs, op)
            problems += check_reduction(dst, inputs, op, f"{dtype} {op} {name}")
    whole = torch.arange(16, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="partially overlaps"):
        dc.host_reduce(whole[:8], [whole[:8], whole[4:12]], "sum")
    for count in (0, 1, 7):
        t = gen("one rank", 0, (count,), "float32")
        expected = t.clone()
        if dc.device_allreduce(t, "sum") != "cuda_ipc" or not torch.equal(t, expected):
            problems.append(f"a group of one rank changed {count} elements")
        dc.device_reduce_scatter(t, [count], "max")
        dc.device_allgather(t, [count])
        if not torch.equal(t, expected):
            problems.append(f"a group of one rank: reduce-scatter or allgather changed {count} elements")
    assert dc.mapped_arenas() == [0]
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------ routes


def _case_routes(ctx, size, key, hosts, subsets):
    if ctx.rank >= size:
        return None
    dc = _make(ctx, size, key, hosts)
    # Every rank unlinks its segment once its host peers have mapped it.
    left = [name for name in os.listdir("/dev/shm") if name.startswith(f"torus-devtest-{os.getpid()}-")]
    return {"mapped": dc.mapped_arenas(), "left_in_dev_shm": left,
            "routes": {tuple(s): dc.route(list(s)) for s in subsets if ctx.rank in s}}


@pytest.mark.parametrize("size,hosts", [
    (2, [0, 0]), (2, [0, 1]), (3, [0, 0, 1]), (4, [0, 1, 0, 1]), (8, [0, 0, 0, 1, 1, 1, 2, 2]),
])
def test_routes_agree_on_every_rank(size, hosts):
    # Every subset of up to 4 ranks that includes rank 0, and the whole group.
    subsets = [list(range(size))] + [list(c) for k in (1, 2, 3) for c in itertools.combinations(range(size), k)]
    results = _run(size, _case_routes, hosts, subsets)
    problems = []
    for rank, result in enumerate(results):
        expected_mapped = [r for r in range(size) if hosts[r] == hosts[rank]]
        if result["left_in_dev_shm"]:
            problems.append(f"rank {rank} left {result['left_in_dev_shm']} in /dev/shm")
        if result["mapped"] != expected_mapped:
            problems.append(f"rank {rank} mapped the arenas of {result['mapped']}, expected {expected_mapped}")
        for subset, route in result["routes"].items():
            expected = "cuda_ipc" if len({hosts[r] for r in subset}) == 1 else "staged"
            if route != expected:
                problems.append(f"rank {rank}: ranks {list(subset)} take {route}, expected {expected}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------ allreduce


def _case_allreduce(ctx, size, key, layout, mode, arena_bytes, chunk_bytes, plan):
    if ctx.rank >= size:
        return None
    hosts, grid = _layout(size, layout)
    dc = _make(ctx, size, key, hosts, arena_bytes, mode)
    problems, digests, routes = [], [], set()
    for dtype, op, count in plan:
        inputs = gen_all((key, dtype, op, count), size, (count,), dtype, op)
        t = inputs[ctx.rank].clone()
        routes.add(dc.device_allreduce(t, op, grid=grid, chunk_bytes=chunk_bytes))
        problems += check_reduction(t, inputs, op, f"{layout} {mode} {dtype} {op} count={count}")
        digests.append(_digest(t))
    return {"problems": problems, "digests": digests, "routes": routes, "stats": dc.stats()}


def _conclude_allreduce(results, size, layout):
    problems = harness.problems([r["problems"] for r in results])
    for rank, result in enumerate(results):
        if result["digests"] != results[0]["digests"]:
            differ = [i for i, (a, b) in enumerate(zip(result["digests"], results[0]["digests"])) if a != b]
            problems.append(f"rank {rank}: results differ from rank 0's bit for bit in calls {differ}")
        if result["routes"] != {_expected_route(size, layout)}:
            problems.append(f"rank {rank}: routes {result['routes']}, expected {_expected_route(size, layout)}")
    assert not problems, "\n".join(problems)


def _plan(dtypes, counts):
    return [(dtype, op, count) for dtype in dtypes for op in OPS for count in counts]


# (size, layout): every route and grid shape, each with the full dtype x op x count matrix.
ALLREDUCE_CASES = [
    (2, "one"), (2, "each"),
    (3, "one"), (3, "each"),
    (4, "one"), (4, "each"), (4, "hostrows:2x2"), (4, "hostflat:2x2"), (4, "onegrid:2x2"), (4, "eachgrid:2x2"),
    (8, "one"), (8, "each"), (8, "hostrows:2x4"), (8, "hostrows:4x2"), (8, "hostflat:2x4"),
]


@pytest.mark.parametrize("mode", ["eager", "deferred"])
@pytest.mark.parametrize("size,layout", ALLREDUCE_CASES)
def test_allreduce(size, layout, mode):
    dtypes, counts = DTYPES, [0, 1, 7, 1000, 4099]
    # Small arenas and chunks: 1000 elements take several arena rounds and several chunks a block.
    results = _run(size, _case_allreduce, layout, mode, SMALL_ARENA, 256, _plan(dtypes, counts))
    _conclude_allreduce(results, size, layout)


@pytest.mark.parametrize("hosts", ["001", "00011122"])
def test_allreduce_uneven_hosts_is_staged_everywhere(hosts):
    """Hosts of different sizes, no grid: a Comm that spans hosts takes the staged ring on
    every rank, although some ranks could map some peers' arenas; no arena byte is touched."""
    size = len(hosts)
    results = _run(size, _case_uneven_hosts, [int(c) for c in hosts])
    problems = harness.problems([r["problems"] for r in results])
    for rank, result in enumerate(results):
        if result["routes"] != {"staged"}:
            problems.append(f"rank {rank}: routes {result['routes']}")
        if result["stats"]["arena_bytes_read"] or result["stats"]["arena_bytes_written"]:
            problems.append(f"rank {rank}: arenas touched on the staged route: {result['stats']}")
        if result["digests"] != results[0]["digests"]:
            problems.append(f"rank {rank}: results differ from rank 0's")
    assert not problems, "\n".join(problems)


def _case_uneven_hosts(ctx, size, key, hosts):
    if ctx.rank >= size:
        return None
    dc = _make(ctx, size, key, hosts, SMALL_ARENA)
    problems, digests, routes = [], [], set()
    for dtype, op, count in _plan(["float32", "int32"], [1, 7, 1000]):
        inputs = gen_all((key, dtype, op, count), size, (count,), dtype, op)
        t = inputs[ctx.rank].clone()
        routes.add(dc.device_allreduce(t, op, chunk_bytes=300))
        problems += check_reduction(t, inputs, op, f"hosts {hosts} {dtype} {op} count={count}")
        digests.append(_digest(t))
    return {"problems": problems, "digests": digests, "routes": routes, "stats": dc.stats()}


def test_degenerate_grids_run_flat():
    """A grid of one row, or of rows of one rank, is no torus: the flat route of the Comm."""
    results = _run(4, _case_degenerate_grids)
    assert not harness.problems(results), "\n".join(harness.problems(results))


def _case_degenerate_grids(ctx, size, key):
    if ctx.rank >= size:
        return None
    dc = _make(ctx, size, key, [0, 0, 1, 1], SMALL_ARENA)
    problems = []
    for grid in ([[0, 1, 2, 3]], [[0], [1], [2], [3]]):
        inputs = gen_all((key, len(grid)), size, (77,), "float64")
        t = inputs[ctx.rank].clone()
        route = dc.device_allreduce(t, "sum", grid=grid, chunk_bytes=64)
        problems += check_reduction(t, inputs, "SUM", f"grid {grid}")
        if route != "staged":
            problems.append(f"grid {grid}: route {route}")
    return problems


# ------------------------------------------------------------------------------ reduce-scatter, allgather


def _uneven_blocks(size, seed):
    """Block counts with empty blocks, one large block, and offsets in another order than the ranks'
    (with gaps between blocks); and the buffer's length."""
    counts = [(seed * 37 + r * 101) % 700 for r in range(size)]
    counts[seed % size] = 0
    if size > 2:
        counts[(seed + 1) % size] = 0
        counts[(seed + 2) % size] = 1500
    order = sorted(range(size), key=lambda r: (r * 5 + seed) % size)
    offsets, offset = [0] * size, 3
    for r in order:
        offsets[r] = offset
        offset += counts[r] + (r % 2) * 5
    return counts, offsets, offset + 4


def _blocks_from(counts, offsets):
    if offsets is None:
        offsets = list(itertools.accumulate([0] + counts[:-1]))
    return offsets


def _case_scatter_gather(ctx, size, key, layout, mode, arena_bytes, chunk_bytes, plan):
    """plan: (collective, dtype, op, counts, offsets or None, length)."""
    if ctx.rank >= size:
        return None
    hosts, _ = _layout(size, layout)
    dc = _make(ctx, size, key, hosts, arena_bytes, mode)
    problems, routes = [], set()
    for i, (collective, dtype, op, counts, offsets, length) in enumerate(plan):
        label = f"{layout} {mode} {collective} {dtype} {op} counts={counts} offsets={offsets}"
        inputs = gen_all((key, i), size, (length,), dtype, op)
        t = inputs[ctx.rank].clone()
        starts = _blocks_from(counts, offsets)
        mine = slice(starts[ctx.rank], starts[ctx.rank] + counts[ctx.rank])
        if collective == "reduce_scatter":
            routes.add(dc.device_reduce_scatter(t, counts, op, chunk_bytes=chunk_bytes, offsets=offsets))
            problems += check_reduction(t[mine], [x[mine] for x in inputs], op, label)
        else:
            before = t.clone()
            routes.add(dc.device_allgather(t, counts, chunk_bytes=chunk_bytes, offsets=offsets))
            expected = before.clone()
            for r in range(size):
                block = slice(starts[r], starts[r] + counts[r])
                expected[block] = inputs[r][block]
            # Outside every block the buffer is left as it was.
            problems += compare(t, expected, None, label)
    return {"problems": problems, "routes": routes, "stats": dc.stats()}


def _scatter_gather_plan(size, dtypes):
    plan = []
    for seed, dtype in enumerate(dtypes):
        counts, offsets, length = _uneven_blocks(size, seed)
        even = [length // size + (r < length % size) for r in range(size)]
        for op in OPS:
            plan.append(("reduce_scatter", dtype, op, counts, offsets, length))
        plan.append(("reduce_scatter", dtype, "SUM", even, None, length))
        plan.append(("reduce_scatter", dtype, "MAX", [0] * size, None, 5))
        plan.append(("allgather", dtype, "SUM", counts, offsets, length))
        plan.append(("allgather", dtype, "SUM", even, None, length))
        plan.append(("allgather", dtype, "SUM", [1] + [0] * (size - 1), None, 1))
    return plan


@pytest.mark.parametrize("mode", ["eager", "deferred"])
@pytest.mark.parametrize("size,layout", [(2, "one"), (2, "each"), (3, "one"), (3, "each"), (4, "one"),
                                         (4, "each"), (4, "hostflat:2x2"), (8, "one"), (8, "each")])
def test_reduce_scatter_and_allgather_uneven_blocks(size, layout, mode):
    results = _run(size, _case_scatter_gather, layout, mode, SMALL_ARENA, 200, _scatter_gather_plan(size, DTYPES))
    problems = harness.problems([r["problems"] for r in results])
    expected = "cuda_ipc" if layout == "one" else "staged"
    for rank, result in enumerate(results):
        if result["routes"] != {expected}:
            problems.append(f"rank {rank}: routes {result['routes']}, expected {expected}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------ rounds, chunks, reuse


def _case_back_to_back(ctx, size, key, layout, mode, arena_bytes, steps):
    """steps: (collective, dtype, count, chunk_bytes) on one object, back to back; returns the
    path's stats after each."""
    if ctx.rank >= size:
        return None
    hosts, grid = _layout(size, layout)
    dc = _make(ctx, size, key, hosts, arena_bytes, mode)
    problems, stats, digests = [], [], []
    for i, (collective, dtype, count, chunk_bytes) in enumerate(steps):
        label = f"{layout} {mode} step {i}: {collective} {dtype} count={count} chunk_bytes={chunk_bytes}"
        inputs = gen_all((key, i), size, (count,), dtype)
        t = inputs[ctx.rank].clone()
        counts = [count // size + (r < count % size) for r in range(size)]
        starts = _blocks_from(counts, None)
        mine = slice(starts[ctx.rank], starts[ctx.rank] + counts[ctx.rank])
        if collective == "allreduce":
            dc.device_allreduce(t, "sum", grid=grid, chunk_bytes=chunk_bytes)
            problems += check_reduction(t, inputs, "SUM", label)
            digests.append(_digest(t))
        elif collective == "reduce_scatter":
            dc.device_reduce_scatter(t, counts, "sum", chunk_bytes=chunk_bytes)
            problems += check_reduction(t[mine], [x[mine] for x in inputs], "SUM", label)
        else:
            dc.device_allgather(t, counts, chunk_bytes=chunk_bytes)
            problems += compare(t, torch.cat([inputs[r][starts[r]:starts[r] + counts[r]] for r in range(size)]),
                                None, label)
        stats.append(dc.stats())
    return {"problems": problems, "stats": stats, "digests": digests}


# Sizes that take an odd and an even number of arena rounds (so the next call starts on the half
# the last one used, or the other), chunks of one element, of a size no element divides, and
# larger than the blocks; staging that grows (kMirror, kSlots) and is then reused.
BACK_TO_BACK = [
    ("allreduce", "float32", 3000, 100),
    ("allreduce", "float32", 3000, 100),
    ("reduce_scatter", "float64", 2500, 3),
    ("allgather", "float64", 2500, 1000),
    ("allreduce", "float64", 9001, 4096),
    ("allreduce", "bfloat16", 777, 2),
    ("allreduce", "float32", 10, 64),
    ("allgather", "int32", 5003, 333),
    ("allreduce", "float32", 3000, 100),
    ("allreduce", "float32", 3000, 100),
]


@pytest.mark.parametrize("mode", ["eager", "deferred"])
@pytest.mark.parametrize("size,layout", [(2, "one"), (3, "each"), (4, "hostrows:2x2"), (4, "onegrid:2x2"),
                                         (4, "eachgrid:2x2"), (8, "hostrows:2x4")])
def test_back_to_back_calls_reuse_arenas_and_staging(size, layout, mode):
    results = _run(size, _case_back_to_back, layout, mode, SMALL_ARENA, BACK_TO_BACK)
    problems = harness.problems([r["problems"] for r in results])
    for rank, result in enumerate(results):
        stats = result["stats"]
        if result["digests"] != results[0]["digests"]:
            problems.append(f"rank {rank}: allreduce results differ from rank 0's")
        # The last two calls repeat the first two: warm, they allocate no staging.
        if stats[-1]["staging_allocations"] != stats[-3]["staging_allocations"]:
            problems.append(f"rank {rank}: staging allocated on warm calls: {stats[-3]} -> {stats[-1]}")
        route = _expected_route(size, layout)
        arenas, staged = stats[-1]["arena_bytes_read"], stats[-1]["staging_bytes"]
        if ("cuda_ipc" in route) != (arenas > 0) or ("staged" in route) != (staged > 0):
            problems.append(f"rank {rank}: route {route}, but arena bytes read {arenas}, staging bytes {staged}")
        if "cuda_ipc" in route and arenas <= SMALL_ARENA:
            problems.append(f"rank {rank}: {arenas} arena bytes read: a single round?")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------ the algorithms directly


def _case_direct(ctx, size, key, mode):
    """On hosts [0, 0, 1, 1]: the staged rings on a Comm of one host (which device_* would send
    through arenas), the staged reduce-scatter then the mirrored allgather (the flat allreduce's
    pair) with uneven blocks, the arena algorithms on each host's Comm, and the arena algorithms
    refused on a Comm across hosts."""
    if ctx.rank >= size:
        return None
    hosts = [0, 0, 1, 1]
    dc = _make(ctx, size, key, hosts, SMALL_ARENA, mode)
    host = [r for r in range(size) if hosts[r] == hosts[ctx.rank]]
    me = host.index(ctx.rank)
    problems = []
    for i, (dtype, op) in enumerate((("float32", "SUM"), ("int32", "PRODUCT"), ("bool", "MAX"),
                                     ("bfloat16", "MAX"))):
        counts, offsets = [1400, 3], [5, 0]
        length = 1405
        inputs = {r: gen((key, i), r, (length,), dtype, op) for r in range(size)}
        for algorithm in ("staged", "arena"):
            t = inputs[ctx.rank].clone()
            mine = slice(offsets[me], offsets[me] + counts[me])
            if algorithm == "staged":
                dc.staged_ring_reduce_scatter(t, counts, op, chunk_bytes=128, offsets=offsets, ranks=host)
            else:
                dc.arena_reduce_scatter(t, counts, op, offsets=offsets, ranks=host)
            label = f"{algorithm} reduce-scatter on host {hosts[ctx.rank]} {dtype} {op}"
            problems += check_reduction(t[mine], [inputs[r][mine] for r in host], op, label)
            if algorithm == "staged":
                dc.staged_ring_allgather(t, counts, chunk_bytes=128, mirrored=True, offsets=offsets, ranks=host)
            else:
                dc.arena_allgather(t, counts, offsets=offsets, ranks=host)
            for b in range(len(host)):
                block = slice(offsets[b], offsets[b] + counts[b])
                problems += check_reduction(t[block], [inputs[r][block] for r in host], op,
                                            f"{label} then allgather, block {b}")
    for name, call in (("arena_reduce_scatter", lambda t: dc.arena_reduce_scatter(t, [1] * size, "sum")),
                       ("arena_allgather", lambda t: dc.arena_allgather(t, [1] * size))):
        try:
            call(torch.zeros(size))
            problems.append(f"{name} on a Comm across hosts was accepted")
        except ValueError as e:
            if "device arenas on every rank" not in str(e):
                problems.append(f"{name}: unclear error {e}")
    # The group still works after the refusals.
    inputs = gen_all((key, "after"), size, (100,), "float64")
    t = inputs[ctx.rank].clone()
    dc.device_allreduce(t, "sum", chunk_bytes=64)
    problems += check_reduction(t, inputs, "SUM", "allreduce after the refusals")
    return problems


@pytest.mark.parametrize("mode", ["eager", "deferred"])
def test_algorithms_directly_on_subset_comms(mode):
    results = _run(4, _case_direct, mode)
    assert not harness.problems(results), "\n".join(harness.problems(results))


# ------------------------------------------------------------------------------ refusals


def _case_refusals(ctx, size, key):
    """Mistakes every rank makes alike raise ValueError on every rank, before any byte moves, and
    the group keeps working."""
    if ctx.rank >= size:
        return None
    tiny = _make(ctx, size, key + "-tiny", [0] * size, arena_bytes=16)
    dc = _make(ctx, size, key, [0, 0, 1, 1], SMALL_ARENA)
    problems = []
    for name, call, words in (
            ("arena too small for 4 ranks", lambda: tiny.device_allreduce(torch.ones(100), "sum"),
             ["16 bytes", "4 ranks"]),
            ("band of floats", lambda: dc.device_allreduce(torch.ones(10), "band"), ["band", "float32"]),
            ("unknown op", lambda: dc.device_allreduce(torch.ones(10), "avg"), ["avg"]),
            ("grid of 3 ranks", lambda: dc.device_allreduce(torch.ones(10), "sum", grid=[[0, 1], [2]]), []),
            ("block past the end", lambda: dc.device_reduce_scatter(torch.ones(10), [3, 3, 3, 2]), ["outside"]),
            ("overlapping blocks", lambda: dc.device_allgather(torch.ones(10), [3, 3, 3, 1], offsets=[0, 2, 6, 9]),
             ["overlaps"]),
            ("wrong number of blocks", lambda: dc.device_allgather(torch.ones(10), [5, 5]), ["2 block counts"]),
            ("non-contiguous", lambda: dc.device_allreduce(torch.ones(10, 2).t(), "sum"), ["contiguous"]),
            ("not a member", lambda: dc.device_allreduce(torch.ones(10), "sum",
                                                         ranks=[r for r in range(size) if r != ctx.rank]),
             ["lack this rank"]),
    ):
        try:
            call()
            problems.append(f"{name}: accepted")
        except ValueError as e:
            missing = [w for w in words if w not in str(e)]
            if missing:
                problems.append(f"{name}: the error lacks {missing}: {e}")
    inputs = gen_all((key, "after"), size, (1000,), "float32")
    t = inputs[ctx.rank].clone()
    dc.device_allreduce(t, "sum", grid=[[0, 1], [2, 3]], chunk_bytes=512)
    problems += check_reduction(t, inputs, "SUM", "torus allreduce after the refusals")
    return problems


def test_refusals_leave_the_group_working():
    results = _run(4, _case_refusals)
    assert not harness.problems(results), "\n".join(harness.problems(results))
