"""Algorithm selection without processes: rule syntax, tables, grids, the cost model."""

import math

import pytest

from torch_torus.config import MAX_BYTES, Rule, parse_rules
from torch_torus.config import ConfigError
from torch_torus.cost_model import allreduce_seconds, auto_allreduce_rules
from torch_torus.selection import overlay, resolve_tables
from torch_torus.topology import choose_grid
from torch_torus import config


def covers_every_size(rules):
    assert rules[0].lo == 0 and rules[-1].hi == MAX_BYTES
    for before, after in zip(rules, rules[1:]):
        assert after.lo == before.hi + 1


@pytest.mark.parametrize("text, expected", [
    ("ring", [Rule("ring", 0, MAX_BYTES)]),
    ("  Torus ", [Rule("torus", 0, MAX_BYTES)]),
    ("auto", []),
    ("recursive_doubling:0-8192;rabenseifner:8193-1048576;ring:1048577-max",
     [Rule("recursive_doubling", 0, 8192), Rule("rabenseifner", 8193, 1048576), Rule("ring", 1048577, MAX_BYTES)]),
    ("ring:1M-max;direct:0-1023", [Rule("direct", 0, 1023), Rule("ring", 1 << 20, MAX_BYTES)]),
    ("ring:0-4K;", [Rule("ring", 0, 4096)]),
    ("auto:0-100;ring:101-max", [Rule("ring", 101, MAX_BYTES)]),
])
def test_rule_forms(text, expected):
    assert list(parse_rules(text, "allreduce")) == expected


@pytest.mark.parametrize("text, message", [
    ("ring:0-100;direct:100-max", "overlap"),
    ("ring:9-3", "reversed"),
    ("ring:x-3", "byte counts"),
    ("ring:0-max;bogus:1-2", "unknown algorithm 'bogus'"),
    (";", "no rules"),
    ("ring:0", "<algorithm>:<lo>-<hi>"),
    ("ring:max-max", "byte counts"),
])
def test_rule_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_rules(text, "allreduce")


def test_overlay_fills_gaps_with_automatic_choice():
    user = parse_rules("ring:0-100;torus:5000-max", "allreduce")
    automatic = (Rule("recursive_doubling", 0, 999), Rule("direct", 1000, MAX_BYTES))
    table = overlay(user, automatic)
    assert [str(r) for r in table] == ["ring:0-100", "recursive_doubling:101-999", "direct:1000-4999", "torus:5000-max"]
    covers_every_size(table)


def test_tables_cover_every_size_for_every_collective():
    values = config.resolve(None, environ={"TORUS_ALLREDUCE": "ring:0-10"})
    for size in (1, 2, 3, 4, 5, 7, 8, 12, 16, 1024):
        tables = resolve_tables(values, size, choose_grid(size, ["h"] * size, None))
        for rules in tables.values():
            covers_every_size(rules)
        first = tables["allreduce"][0]
        assert first.algorithm == "ring" and first.hi >= 10


@pytest.mark.parametrize("size, hosts, dims, shape, reason", [
    (8, ["a"] * 4 + ["b"] * 4, None, (2, 4), "one row per host"),
    (8, ["a", "b"] * 4, None, (2, 4), "one row per host"),
    (12, ["a"] * 3 + ["b"] * 3 + ["c"] * 3 + ["d"] * 3, None, (4, 3), "one row per host"),
    (8, ["h"] * 8, None, (2, 4), "most square"),
    (16, ["h"] * 16, None, (4, 4), "most square"),
    (1024, ["h"] * 1024, None, (32, 32), "most square"),
    (8, ["a"] * 6 + ["b"] * 2, None, (2, 4), "most square"),  # uneven hosts: no host rows
    (8, [str(i) for i in range(8)], None, (2, 4), "most square"),  # one rank per host
    (8, ["h"] * 8, (4, 2), (4, 2), "TORUS_TORUS_DIMS"),
    (6, ["h"] * 6, (1, 6), (1, 6), "TORUS_TORUS_DIMS"),
])
def test_grid_choice(size, hosts, dims, shape, reason):
    grid = choose_grid(size, hosts, dims)
    assert grid.shape == shape and reason in grid.reason
    assert sorted(r for row in grid.rows for r in row) == list(range(size))
    if reason == "one row per host":
        for row in grid.rows:
            assert len({hosts[r] for r in row}) == 1


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 13])
def test_no_grid_for_primes_and_one(size):
    assert choose_grid(size, ["h"] * size, None) is None


def test_dims_that_do_not_fit_name_the_variable():
    with pytest.raises(ConfigError, match=r"TORUS_TORUS_DIMS=3x3 .*8 ranks"):
        choose_grid(8, ["h"] * 8, (3, 3))


def test_cost_model_is_monotonic_in_size_and_picks_latency_optimal_small():
    for algorithm in ("ring", "direct", "recursive_doubling", "rabenseifner", "torus"):
        times = [allreduce_seconds(algorithm, 1 << k, 16, (4, 4)) for k in range(0, 30)]
        assert times == sorted(times)
    rules = auto_allreduce_rules(16, ("ring", "recursive_doubling", "rabenseifner", "torus"), (4, 4), "ring")
    covers_every_size(rules)
    assert rules[0].algorithm == "recursive_doubling"
    assert rules[-1].algorithm != "recursive_doubling"


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8, 12, 16])
def test_steps_add_up_to_the_formulas(n):
    """Each algorithm's step list gives what the module's docstring says one rank does."""
    s = 1 << 20
    k = math.log2(1 << (n.bit_length() - 1))
    p = 2 ** k
    fold = (2, 2 * s, s) if n != p else (0, 0, 0)
    expected = {
        "ring": (2 * (n - 1), 2 * s * (n - 1) / n, s * (n - 1) / n, 0),
        "direct": (2, 2 * s * (n - 1) / n, s * (n - 1) / n, 2 * (n - 2)),
        "recursive_doubling": (k + fold[0], k * s + fold[1], k * s + fold[2], 0),
        "rabenseifner": (2 * k + fold[0], 2 * s * (p - 1) / p + fold[1], s * (p - 1) / p + fold[2], 0),
        "one_shot": (1, s, (n - 1) * s, 0),
        "two_shot": (2, 2 * s * (n - 1) / n, s * (n - 1) / n, 0),
    }
    for algorithm, (steps, wire, reduced, extra) in expected.items():
        terms = cost_model.allreduce_terms(algorithm, s, n)
        assert (terms.steps, terms.extra_messages) == (steps, extra), algorithm
        assert terms.wire_bytes == pytest.approx(wire) and terms.reduced_bytes == pytest.approx(reduced), algorithm
    grid = choose_grid(n, ["h"] * n, None)
    if grid:
        rows, cols = grid.shape
        column = cost_model.allreduce_terms("ring", s // cols, rows)
        torus = cost_model.allreduce_terms("torus", s, n, grid.shape)
        assert torus.steps == 2 * (cols - 1) + column.steps
        assert torus.wire_bytes == pytest.approx(2 * s * (cols - 1) / cols + column.wire_bytes)
        assert torus.reduced_bytes == pytest.approx(s * (cols - 1) / cols + column.reduced_bytes)
    assert cost_model.allreduce_terms("torus", s, n) == cost_model.allreduce_terms("ring", s, n)  # no grid


def test_shared_memory_algorithms_have_no_host_traffic_model():
    with pytest.raises(ValueError, match="one_shot runs in shared memory"):
        host_pattern("one_shot", placed(consecutive(2, 2)))


def test_torus_takes_fewer_steps_than_ring_at_scale():
    # 1024 ranks as 32 x 32: 124 steps against the ring's 2046 (DESIGN.md); latency-bound sizes
    # show it.
    assert allreduce_seconds("torus", 1024, 1024, (32, 32)) < allreduce_seconds("ring", 1024, 1024)


# -- Across hosts: bytes over each host's link ----------------------------------------------------

from torch_torus import cost_model  # noqa: E402
from torch_torus.cost_model import Link, Placement, host_pattern  # noqa: E402
from torch_torus.selection import placement_of  # noqa: E402

ALLREDUCES = ("ring", "torus", "direct", "recursive_doubling", "rabenseifner")


def consecutive(hosts, per_host):
    return [f"node{h}" for h in range(hosts) for _ in range(per_host)]


def placed(hosts):
    return placement_of(hosts, choose_grid(len(hosts), hosts, None))


# Bytes each host sends over its link per allreduce, / S, as the cluster emulator measured them
# (benchmarks/results/cluster_link_util_{2x4,4x2,8x1}_1gbit.txt: ring 1.752, torus 1.002, the
# others 4.003-4.010 at 2 x 4; torus 1.503, rabenseifner and direct 3.004-3.007, recursive
# doubling 4.008 at 4 x 2; 1.753-1.754, recursive doubling 3.005, at 8 x 1).
@pytest.mark.parametrize("hosts, per_host, expected", [
    (2, 4, {"ring": 1.75, "torus": 1.0, "direct": 4.0, "recursive_doubling": 4.0, "rabenseifner": 4.0}),
    (4, 2, {"ring": 1.75, "torus": 1.5, "direct": 3.0, "recursive_doubling": 4.0, "rabenseifner": 3.0}),
    (8, 1, {"ring": 1.75, "torus": 1.75, "direct": 1.75, "recursive_doubling": 3.0, "rabenseifner": 1.75}),
])
def test_bytes_over_each_host_link_match_the_emulator(hosts, per_host, expected):
    placement = placed(consecutive(hosts, per_host))
    for algorithm, share in expected.items():
        pattern = host_pattern(algorithm, placement)
        assert pattern.link_share == pytest.approx(share), algorithm
        # Every host sends the same here, and receives what it sends.
        assert set(round(v, 9) for v in pattern.sent_share.values()) == {round(share, 9)}, algorithm


def test_bytes_over_links_follow_the_formulas_for_other_layouts():
    for hosts, per_host in [(2, 2), (2, 8), (4, 4), (8, 2), (3, 4), (2, 3), (2, 40)]:
        n = hosts * per_host
        placement = placed(consecutive(hosts, per_host))
        assert host_pattern("ring", placement).link_share == pytest.approx(2 * (n - 1) / n)
        assert host_pattern("torus", placement).link_share == pytest.approx(2 * (hosts - 1) / hosts)
        assert host_pattern("direct", placement).link_share == pytest.approx(2 * per_host * (n - per_host) / n)
        if n & (n - 1) == 0:  # powers of two: the rounds at distances >= per_host cross
            assert host_pattern("rabenseifner", placement).link_share == pytest.approx(2 * per_host * (n - per_host) / n)
            assert host_pattern("recursive_doubling", placement).link_share == pytest.approx(
                per_host * math.log2(hosts))


def test_placement_not_the_count_decides():
    # Ranks dealt round-robin to 2 hosts: every ring edge crosses, so each host sends its 4 ranks'
    # 2S(n-1)/n; the grid still has one row per host, so the torus's bytes do not change.
    interleaved = placed(["a", "b"] * 4)
    assert host_pattern("ring", interleaved).link_share == pytest.approx(4 * 1.75)
    assert host_pattern("torus", interleaved).link_share == pytest.approx(1.0)
    assert host_pattern("recursive_doubling", interleaved).link_share == pytest.approx(4 * 1.0)


def test_folded_ranks_cross_hosts_too():
    # 6 ranks as 3 + 3: recursive doubling folds rank 1 into 0 (same host) and 3 into 2 (across),
    # runs on 0, 2, 4, 5 (distance 2 crosses twice) and unfolds 2 -> 3: 3S each way, 3 steps.
    pattern = host_pattern("recursive_doubling", placed(consecutive(2, 3)))
    assert pattern.link_share == pytest.approx(3.0) and pattern.crossing_steps == 3


@pytest.mark.parametrize("algorithm", ALLREDUCES)
def test_crossing_steps(algorithm):
    steps = {a: host_pattern(a, placed(consecutive(2, 4))).crossing_steps for a in ALLREDUCES}
    # 2 x 4: the ring's 14 steps all cross; the torus's only in its column phase (2 steps); the
    # direct's 2; recursive doubling's distance-4 round; rabenseifner's two rounds at distance 4.
    assert steps == {"ring": 14, "torus": 2, "direct": 2, "recursive_doubling": 1, "rabenseifner": 2}


def test_link_time_is_bytes_over_bandwidth_plus_latency_when_the_link_bounds_it():
    link = Link.of(1e9 / 8, 20e-6)
    placement = placed(consecutive(2, 4))
    nbytes = 64 << 20
    seconds = cost_model.allreduce_seconds("ring", nbytes, 8, (2, 4), placement=placement, link=link)
    assert seconds == pytest.approx(1.75 * nbytes / (1e9 / 8 * cost_model.TCP_PAYLOAD_SHARE) + 14 * 20e-6)
    # A fast enough link leaves the ranks' own time.
    fast = Link.of(1e15, 0.0)
    assert cost_model.allreduce_seconds("ring", nbytes, 8, (2, 4), placement=placement, link=fast) == \
        cost_model.allreduce_seconds("ring", nbytes, 8, (2, 4))


def test_rounds_of_recursive_doubling_and_rabenseifner_run_one_after_another():
    # 2 x 4: rabenseifner's halving and doubling rounds at distance 4 cross (2S over each link
    # each), those at distances 2 and 1 stay on the host; each round takes the longer of its
    # transfer over the link and the ranks' own time, and the rounds add up.
    link = Link.of(1e9 / 8, 20e-6)
    placement = placed(consecutive(2, 4))
    machine = cost_model.DEFAULT_MACHINE
    rounds = cost_model.host_rounds("rabenseifner", placement)
    assert [(r.sent, r.reduced, r.link_share, r.crosses) for r in rounds] == [
        (0.5, 0.5, 2.0, True), (0.25, 0.25, 0.0, False), (0.125, 0.125, 0.0, False),
        (0.125, 0.0, 0.0, False), (0.25, 0.0, 0.0, False), (0.5, 0.0, 2.0, True)]
    nbytes = 64 << 20
    expected = sum(max(machine.seconds(cost_model.Terms(1, r.sent * nbytes, r.reduced * nbytes, 0)),
                       r.link_share * nbytes / link.bandwidth + (link.latency if r.crosses else 0))
                   for r in rounds)
    assert cost_model.allreduce_seconds("rabenseifner", nbytes, 8, (2, 4), placement=placement, link=link) == \
        pytest.approx(expected)
    # The rounds' own terms add up to one host's.
    for algorithm in ("recursive_doubling", "rabenseifner"):
        for hosts, per_host in [(2, 4), (2, 3), (3, 2)]:
            rounds = cost_model.host_rounds(algorithm, placed(consecutive(hosts, per_host)))
            terms = cost_model.allreduce_terms(algorithm, 1 << 20, hosts * per_host)
            assert sum(r.sent for r in rounds) * (1 << 20) == pytest.approx(terms.wire_bytes)
            assert sum(r.reduced for r in rounds) * (1 << 20) == pytest.approx(terms.reduced_bytes)
            assert len(rounds) == terms.steps


def test_torus_row_and_column_phases_add_up_with_one_segment_and_overlap_with_many():
    link = Link.of(1e9 / 8, 20e-6)
    placement = placed(consecutive(4, 2))  # 4 x 2 grid: a segment is 2 x 4 x 512 KiB = 4 MiB
    machine = cost_model.DEFAULT_MACHINE
    assert cost_model.torus_segments(4 << 20, 2) == 1 and cost_model.torus_segments(64 << 20, 2) == 16
    assert cost_model.torus_segments(4 << 20, 2, chunk_bytes=128 << 10) == 4

    def phases(nbytes):
        rows = machine.seconds(cost_model.Terms(2, nbytes, nbytes / 2, 0))  # ring reduce-scatter + allgather over 2
        column_link = host_pattern("torus", placement, "ring", "columns")
        assert column_link.link_share == pytest.approx(1.5) and column_link.crossing_steps == 6
        assert host_pattern("torus", placement, "ring", "rows").link_share == 0
        columns = max(machine.seconds(cost_model.allreduce_terms("ring", nbytes // 2, 4)),
                      1.5 * nbytes / link.bandwidth + 6 * link.latency)
        return rows, columns

    rows, columns = phases(4 << 20)
    assert cost_model.allreduce_seconds("torus", 4 << 20, 8, (4, 2), placement=placement, link=link) == \
        pytest.approx(rows + columns)
    rows, columns = phases(64 << 20)
    assert cost_model.allreduce_seconds("torus", 64 << 20, 8, (4, 2), placement=placement, link=link) == \
        pytest.approx(max(rows, columns) + min(rows, columns) / 16)


@pytest.mark.parametrize("size", [2, 4, 8, 16])
def test_one_host_tables_are_unchanged(size):
    hosts = ["h"] * size
    grid = choose_grid(size, hosts, None)
    for environ in ({}, {"TORUS_LINK_BANDWIDTH": "1gbit", "TORUS_LINK_LATENCY": "5ms"}):
        values = config.resolve(None, environ=environ)
        for transport in ("tcp", "shm"):
            assert resolve_tables(values, size, grid, transport, hosts=hosts) == \
                resolve_tables(values, size, grid, transport)
    assert placed(hosts) is None


def at(table, nbytes):
    return next(rule.algorithm for rule in table if rule.lo <= nbytes <= rule.hi)


def test_across_hosts_auto_counts_the_shared_links():
    # 1 Gbit/s links (the emulator's): recursive doubling for small messages, then the torus
    # with several ranks per host (its column phase is all that crosses), the ring with one rank
    # per host (every algorithm but recursive doubling puts 2S(n-1)/n on each link; ties go to
    # the ring). Rabenseifner, which one host's model picks for large messages, never.
    values = config.resolve(None, environ={"TORUS_LINK_BANDWIDTH": "1gbit"})
    tables = {}
    for hosts, per_host in [(2, 4), (4, 2), (8, 1)]:
        placement_hosts = consecutive(hosts, per_host)
        grid = choose_grid(8, placement_hosts, None)
        tables[hosts, per_host] = resolve_tables(values, 8, grid, hosts=placement_hosts)["allreduce"]
        covers_every_size(tables[hosts, per_host])
        assert at(tables[hosts, per_host], 4096) == "recursive_doubling"
        for nbytes in (1 << 20, 16 << 20, 64 << 20, 1 << 30):
            assert at(tables[hosts, per_host], nbytes) != "rabenseifner"
    for nbytes in (1 << 20, 64 << 20):
        assert at(tables[2, 4], nbytes) == "torus"
        assert at(tables[8, 1], nbytes) == "ring"
    # At 4 x 2 the torus saves 14% of the link's bytes (1.5 S against 1.75 S), but up to 4 MiB it
    # is a single segment whose row phases do not overlap its column phase: the ring until then.
    assert at(tables[4, 2], 1 << 20) == "ring" and at(tables[4, 2], 4 << 20) == "ring"
    assert at(tables[4, 2], 16 << 20) == "torus" and at(tables[4, 2], 64 << 20) == "torus"
    # Near-ties go to the fewest bytes over the link: at 2 x 4, 256 KiB, ring and torus are
    # predicted within 1%, and the torus sends 1.0 S over each link against the ring's 1.75 S.
    assert at(tables[2, 4], 256 << 10) == "torus"


def test_slower_links_move_large_messages_to_fewer_link_bytes():
    hosts = consecutive(2, 4)
    grid = choose_grid(8, hosts, None)
    table = resolve_tables(config.resolve(None, environ={"TORUS_LINK_BANDWIDTH": "100mbit"}), 8, grid,
                           hosts=hosts)["allreduce"]
    assert at(table, 1 << 20) == "torus" and at(table, 1 << 30) == "torus"


def test_crowded_latency_counts_ranks_beyond_one_per_core():
    from torch_torus.cost_model import Machine

    machine = Machine(latency=2e-6, bandwidth=1e9, reduce_rate=1e9, message_overhead=0.0, crowded_latency=20e-6)
    assert machine.on_host(2, 2).latency == pytest.approx(2e-6)
    assert machine.on_host(1, 2).latency == pytest.approx(2e-6)
    assert machine.on_host(8, 2).latency == pytest.approx(2e-6 + 3 * 20e-6)
    assert machine.on_host(6, 4).latency == pytest.approx(2e-6 + 0.5 * 20e-6)
    assert machine.on_host(8, 2).crowded_latency == 0.0


def _one_shot_up_to(rules):
    assert rules[0].algorithm == "one_shot" and rules[1].algorithm == "two_shot"
    return rules[0].hi


@pytest.mark.parametrize("size", [4, 8])
def test_shared_memory_crossover_follows_the_ranks_per_core(size):
    """Where ranks outnumber cores a step waits for peers to get a core, so the one-step
    one_shot stays ahead of two_shot to larger sizes than with a core per rank; measured on 2
    cores: near 256 KiB at 4 and 8 ranks (BENCHMARKS.md, issue 18)."""
    from torch_torus.selection import auto_rules

    grid = choose_grid(size, ["h"] * size, None)
    crowded = auto_rules("allreduce", size, grid, "ring", "shm", cores=2)
    spacious = auto_rules("allreduce", size, grid, "ring", "shm", cores=size)
    covers_every_size(crowded)
    assert _one_shot_up_to(crowded) > 4 * _one_shot_up_to(spacious)
    assert 64 << 10 <= _one_shot_up_to(crowded) <= 512 << 10
    # Over TCP the machine has no crowding term: the core count changes nothing.
    assert auto_rules("allreduce", size, grid, "ring", "tcp", cores=2) == \
        auto_rules("allreduce", size, grid, "ring", "tcp", cores=size)
