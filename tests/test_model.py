"""The cluster model (python -m torch_torus.model): limits, monotonic behaviour, agreement with
the cost model that auto uses on one host, fitting, and the seed study's ordering."""

from __future__ import annotations

import dataclasses
import json

import pytest

from torch_torus import cost_model, model
from torch_torus.model import NURION, System, allreduce_seconds, images_per_second_per_node

ALGORITHMS = model.ALGORITHMS
SIZES = [4096, 1 << 20, 25 << 20]


def at(system: System, nodes: int, **changes) -> System:
    return dataclasses.replace(system, nodes=nodes, **changes)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_one_rank_costs_only_the_call(algorithm):
    one = at(NURION, 1)
    assert allreduce_seconds(one, algorithm, 25 << 20) == NURION.call_overhead
    assert images_per_second_per_node(one, algorithm) <= NURION.batch_per_node / NURION.compute_seconds


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("nodes", [2, 16, 256, 4096])
def test_faster_links_and_lower_latency_never_slow_an_allreduce(algorithm, nodes):
    system = at(NURION, nodes)
    for nbytes in SIZES:
        base = allreduce_seconds(system, algorithm, nbytes)
        assert allreduce_seconds(dataclasses.replace(system, link_bandwidth=2 * system.link_bandwidth), algorithm, nbytes) < base
        assert allreduce_seconds(dataclasses.replace(system, link_latency=system.link_latency / 2), algorithm, nbytes) < base
        assert allreduce_seconds(dataclasses.replace(system, blocking=0.0), algorithm, nbytes) <= base
    rates = [images_per_second_per_node(dataclasses.replace(system, link_bandwidth=b), algorithm)
             for b in (1e9, 4e9, 16e9, 64e9)]
    assert rates == sorted(rates)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_time_grows_with_bytes_and_ranks(algorithm):
    times = [allreduce_seconds(at(NURION, 64), algorithm, 1 << k) for k in range(0, 30, 2)]
    assert times == sorted(times)
    by_nodes = [allreduce_seconds(at(NURION, n), algorithm, 25 << 20) for n in (2, 4, 16, 64, 256, 1024, 4096)]
    assert by_nodes == sorted(by_nodes)


def test_images_per_second_never_exceed_compute_bound():
    for nodes in (16, 1024, 4096):
        for algorithm in ALGORITHMS:
            assert images_per_second_per_node(at(NURION, nodes), algorithm) <= NURION.batch_per_node / NURION.compute_seconds


@pytest.mark.parametrize("algorithm", model.MODELLED)
@pytest.mark.parametrize("ranks", [2, 3, 4, 6, 8])
def test_on_one_host_it_is_the_cost_model(algorithm, ranks):
    machine = cost_model.DEFAULT_MACHINE
    system = System(nodes=1, ranks_per_node=ranks, local_latency=machine.latency, local_bandwidth=machine.bandwidth,
                    reduce_rate=machine.reduce_rate, message_overhead=machine.message_overhead, call_overhead=0.0)
    shape = model.default_shape(ranks)
    for nbytes in SIZES + [4097, 1]:
        expected = cost_model.allreduce_seconds(algorithm, nbytes, ranks, shape)
        if algorithm == "two_shot":  # single copies, half a message's two (see the module's docstring)
            terms = cost_model.allreduce_terms(algorithm, nbytes, ranks)
            expected -= terms.wire_bytes / 2 / machine.bandwidth
        predicted = allreduce_seconds(system, algorithm, nbytes, shape if algorithm == "torus" else None)
        assert predicted == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("hosts, per_host", [(2, 4), (4, 2), (8, 1), (2, 2)])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_across_hosts_the_link_carries_the_selection_models_bytes(algorithm, hosts, per_host):
    """With everything but the host links free, an allreduce takes the bytes over the busiest
    link, as the selection model counts them for the same placement, over the link's rate."""
    free = System(nodes=hosts, ranks_per_node=per_host, link_bandwidth=1e9, link_latency=0.0, local_bandwidth=1e30,
                  local_latency=0.0, reduce_rate=1e30, nodes_per_switch=hosts)
    n = hosts * per_host
    shape = (hosts, per_host) if per_host > 1 else model.default_shape(n)
    placement = cost_model.Placement(tuple(r // per_host for r in range(n)), cost_model.row_major(shape))
    link_share = cost_model.host_pattern(algorithm, placement).link_share
    nbytes = 1 << 20
    predicted = allreduce_seconds(free, algorithm, nbytes, shape if algorithm == "torus" else None)
    assert predicted == pytest.approx(link_share * nbytes / free.link_bandwidth, rel=1e-9)


def test_recursive_doublings_fold_pairs_neighbours_on_their_host():
    """6 ranks, 2 per host: ranks 1 and 3 fold into 0 and 2 on their own hosts
    (power_of_two_fold.cc), so only the rounds among 0, 2, 4, 5 cross: 2 of the 4 steps."""
    system = System(nodes=3, ranks_per_node=2, link_latency=1.0, local_latency=0.0, link_bandwidth=1e30,
                    local_bandwidth=1e30, reduce_rate=1e30)
    assert allreduce_seconds(system, "recursive_doubling", 1 << 20) == pytest.approx(2.0)


def test_tied_grids_go_to_the_one_with_more_rows():
    """At 32 Nurion nodes 8x4 and 4x8 move the same bytes in the same steps."""
    system = at(NURION, 32)
    times = [allreduce_seconds(system, "torus", system.bucket_bytes, s) for s in [(8, 4), (4, 8)]]
    assert times[0] == pytest.approx(times[1], rel=1e-12)
    assert model.best_torus_shape(system, system.bucket_bytes) == (8, 4)


def test_cli_reads_figures_in_the_units_convention(capsys):
    model.main(["--preset", "default", "--nodes", "2", "--link-bandwidth", "100gbit", "--link-latency", "2us",
                "--reduce-rate", "5GB/s", "--compute-seconds", "0.5", "--bucket-bytes", "4M"])
    system = capsys.readouterr().out.splitlines()[0]
    assert "link_bandwidth=12500000000.0, link_latency=2e-06" in system
    assert "reduce_rate=5000000000.0" in system and "compute_seconds=0.5" in system
    assert f"bucket_bytes={4 << 20}" in system
    with pytest.raises(SystemExit):
        model.main(["--link-bandwidth", "fast"])
    assert "'fast': expected a rate" in capsys.readouterr().err


def test_torus_shape_must_hold_the_ranks():
    with pytest.raises(ValueError, match="4x4 does not hold 32 ranks"):
        allreduce_seconds(at(NURION, 32), "torus", 1024, (4, 4))


@pytest.mark.parametrize("change, message", [
    ({"nodes": 0}, "nodes must be at least 1"),
    ({"blocking": 1.0}, "blocking must lie in [0, 1)"),
    ({"link_bandwidth": 0}, "link_bandwidth must be greater than 0"),
    ({"link_latency": -1e-6}, "link_latency must not be negative"),
    ({"call_floor": -1e-6}, "call_floor must not be negative"),
])
def test_bad_system_is_refused_naming_the_figure(change, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(NURION, **change).validate()


def test_nurion_parameters_reproduce_the_seed_study():
    """Star-like (direct) best from 16 to 128 nodes, ring at 256, the 2D torus from 512, and the
    32x32 grid the best torus at 1024 nodes, in DDP images/s per node."""
    study = ("direct", "ring", "torus")

    def best(nodes):
        system = at(NURION, nodes)
        return max(study, key=lambda a: images_per_second_per_node(system, a))

    assert [best(n) for n in (16, 32, 64, 128)] == ["direct"] * 4
    assert best(256) == "ring"
    assert [best(n) for n in (512, 1024)] == ["torus", "torus"]
    system = at(NURION, 1024)
    shapes = model.torus_shapes(1024)
    assert max(shapes, key=lambda s: images_per_second_per_node(system, "torus", s)) == (32, 32)


def test_fit_recovers_figures_from_their_own_predictions(tmp_path):
    truth = System(nodes=1, ranks_per_node=4, local_latency=300e-6, local_bandwidth=0.5e9, reduce_rate=2e9,
                   message_overhead=200e-6, call_overhead=50e-6, call_floor=700e-6)
    sizes = [4096, 65536, 1 << 20, 16 << 20]
    times = {a: [allreduce_seconds(truth, a, s, (2, 2) if a == "torus" else None) * 1e6 for s in sizes]
             for a in ALGORITHMS}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"format": "torch_torus tuning", "version": 2, "entries": [
        {"world_size": 4, "grid": [2, 2], "ranks_per_host": [4], "transport": "shm", "allreduce": "ring:0-max",
         "measured": {"sizes": sizes, "time_us": times}}]}))
    measurements = model.load_measurements([str(path)])
    assert len(measurements) == len(ALGORITHMS) * len(sizes)
    fitted = model.fit(System(), measurements)
    for m in measurements:
        assert model.predict(fitted, m) == pytest.approx(m.seconds, rel=0.05)
    # One host: nothing depends on the link, whose figures stay as they were.
    assert (fitted.link_bandwidth, fitted.link_latency) == (System().link_bandwidth, System().link_latency)
    # Figures given stay as given, a zero floor included.
    given = model.fit(System(local_latency=250e-6, call_floor=0.0), measurements, fixed=("local_latency", "call_floor"))
    assert (given.local_latency, given.call_floor) == (250e-6, 0.0)


@pytest.mark.parametrize("algorithm", ALGORITHMS + model.SHARED_MEMORY)
def test_call_floor_bounds_every_algorithm_from_below(algorithm):
    """Where ranks outnumber cores, small allreduces take the floor whatever their steps; large
    ones are untouched; and the torus's three calls share one floor."""
    system = System(nodes=1, ranks_per_node=4, local_latency=40e-6, call_overhead=60e-6)
    floored = dataclasses.replace(system, call_floor=1e-3)
    assert allreduce_seconds(floored, algorithm, 4096) == 1e-3
    big = 256 << 20
    assert allreduce_seconds(floored, algorithm, big) == allreduce_seconds(system, algorithm, big) > 1e-3
    sizes = [1 << k for k in range(10, 28, 2)]
    assert [allreduce_seconds(floored, algorithm, s) for s in sizes] == sorted(
        allreduce_seconds(floored, algorithm, s) for s in sizes)


def test_node_counts():
    assert model.node_counts("16-4096") == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert model.node_counts("1,3") == [1, 3]
    with pytest.raises(ValueError, match="--nodes"):
        model.node_counts("lots")


def test_shared_memory_algorithms_run_on_one_host_only():
    one_host = System(nodes=1, ranks_per_node=4)
    for algorithm in model.SHARED_MEMORY:
        times = [allreduce_seconds(one_host, algorithm, s) for s in (4096, 1 << 20, 16 << 20)]
        assert times == sorted(times) and times[0] > 0
        with pytest.raises(ValueError, match=f"{algorithm} needs every rank on one host"):
            allreduce_seconds(System(nodes=2, ranks_per_node=4), algorithm, 4096)
    # one_shot reduces every rank's whole buffer; two_shot only a slice of each: slower when large.
    assert allreduce_seconds(one_host, "one_shot", 64 << 20) > allreduce_seconds(one_host, "two_shot", 64 << 20)
