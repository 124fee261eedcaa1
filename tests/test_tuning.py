"""Tuning files (TORUS_TUNING_FILE): the table chosen from measurements, the round trip through
the file, refusal of other versions and damaged files, and a group that takes its table."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

import expectations
import harness
from reference import first_line
from torch_torus import config, tuning
from torch_torus.config import MAX_BYTES, ConfigError, Rule
from torch_torus.selection import allreduce_candidates, resolve_tables
from torch_torus.topology import choose_grid, choose_transport

SIZES = [4096, 65536, 1 << 20, 16 << 20]
TIMES = {  # microseconds: recursive doubling wins small, rabenseifner at 1M, ring at 16M
    "ring": [900.0, 1500.0, 6000.0, 60000.0],
    "recursive_doubling": [300.0, 700.0, 7000.0, 75000.0],
    "rabenseifner": [600.0, 1200.0, 4000.0, 62000.0],
}


def layout_of(size, hosts=None, transport=None):
    hosts = hosts or ["h"] * size
    return tuning.Layout.of(hosts, choose_grid(size, hosts, None), transport or choose_transport("auto", hosts))


def test_table_takes_each_sizes_winner_and_switches_between_sizes():
    rules = tuning.rules_from_measurements(SIZES, TIMES)
    assert rules == (Rule("recursive_doubling", 0, 256 << 10), Rule("rabenseifner", (256 << 10) + 1, 4 << 20),
                     Rule("ring", (4 << 20) + 1, MAX_BYTES))


def test_an_algorithm_not_run_at_a_size_never_wins_there():
    """null: the algorithm's group runs another at that size (one_shot above its slot), so the
    table must not name it there however the others compare."""
    times = {"one_shot": [10.0, None, None, None], "two_shot": [20.0, 50.0, 300.0, 900.0],
             "ring": [30.0, 40.0, 200.0, 1000.0]}
    assert tuning.rules_from_measurements(SIZES, times) == (
        Rule("one_shot", 0, 16384), Rule("ring", 16385, 4 << 20), Rule("two_shot", (4 << 20) + 1, MAX_BYTES))
    with pytest.raises(ValueError, match="at least one algorithm"):
        tuning.rules_from_measurements(SIZES, {"one_shot": [10.0, None, 1.0, 1.0]})


def test_layout_key_reflects_world_grid_and_hosts():
    assert layout_of(4) == tuning.Layout(4, (2, 2), (4,), "shm")
    assert layout_of(4, transport="tcp") == tuning.Layout(4, (2, 2), (4,), "tcp")
    assert layout_of(8, ["a"] * 4 + ["b"] * 4) == tuning.Layout(8, (2, 4), (4, 4), "shm+tcp")
    assert layout_of(5) == tuning.Layout(5, None, (5,), "shm")


def test_round_trip_and_replacement_of_the_same_layout(tmp_path):
    path = str(tmp_path / "tuning.json")
    four, eight = layout_of(4), layout_of(8)
    tuning.write(path, tuning.make_entry(four, SIZES, TIMES, {"note": "first"}))
    tuning.write(path, tuning.make_entry(eight, SIZES, {"ring": [1.0] * 4}, {}))
    tuning.write(path, tuning.make_entry(four, SIZES, TIMES, {"note": "second"}))
    entries = tuning.read(path)
    assert [e.layout for e in entries] == [eight, four]
    assert entries[1].record["note"] == "second"
    assert entries[1].allreduce == tuning.rules_from_measurements(SIZES, TIMES)
    assert entries[1].record["measured"] == {"sizes": SIZES, "time_us": TIMES}
    # The printed range string is a valid TORUS_ALLREDUCE that gives the same table.
    assert config.parse_rules(entries[1].range_string, "allreduce") == entries[1].allreduce
    hosts = ["h"] * 4
    assert tuning.tuned_allreduce(path, hosts, choose_grid(4, hosts, None), "shm") == entries[1].allreduce


def test_no_file_or_no_matching_entry_leaves_the_cost_model(tmp_path):
    path = str(tmp_path / "tuning.json")
    tuning.write(path, tuning.make_entry(layout_of(4), SIZES, TIMES, {}))
    assert tuning.tuned_allreduce("", ["h"] * 4, None, "shm") is None
    for hosts in (["h"] * 6, ["a", "a", "b", "b"]):  # other world size; other host layout
        assert tuning.tuned_allreduce(path, hosts, choose_grid(len(hosts), hosts, None), "shm") is None
    # The same ranks over TCP: the shm table does not apply.
    assert tuning.tuned_allreduce(path, ["h"] * 4, choose_grid(4, ["h"] * 4, None), "tcp") is None


def test_a_layout_without_a_table_runs_the_cost_model_on_the_memory_the_tuner_measured(tmp_path):
    import torch_torus
    from torch_torus.cost_model import SHM_FIT_MEMORY_GBPS, SHM_MACHINE

    faster = SHM_MACHINE.with_memory(4 * SHM_FIT_MEMORY_GBPS)
    assert (faster.bandwidth, faster.reduce_rate, faster.latency) == pytest.approx(
        (4 * SHM_MACHINE.bandwidth, 4 * SHM_MACHINE.reduce_rate, SHM_MACHINE.latency))
    path = str(tmp_path / "tuning.json")
    memory = {"gbps": 4 * SHM_FIT_MEMORY_GBPS, "bytes_per_process": 64 << 20, "processes": 2, "rounds": 5,
              "copies_per_round": 4}
    tuning.write(path, tuning.make_entry(layout_of(4), SIZES, TIMES, {"host_memory": memory}))
    assert tuning.host_memory_gbps(path) == 4 * SHM_FIT_MEMORY_GBPS
    # The model was fitted against plain copies: a file that holds both figures gives the plain one.
    both = str(tmp_path / "both.json")
    tuning.write(both, tuning.make_entry(layout_of(4), SIZES, TIMES, {"host_memory": {
        **memory, "plain_gbps": 4 * SHM_FIT_MEMORY_GBPS, "streaming_gbps": 7 * SHM_FIT_MEMORY_GBPS,
        "gbps": 7 * SHM_FIT_MEMORY_GBPS}}))
    assert tuning.host_memory_gbps(both) == 4 * SHM_FIT_MEMORY_GBPS
    values = config.resolve(None, environ={"TORUS_TUNING_FILE": path})
    hosts = ["h"] * 8  # no entry for 8 ranks: the model chooses, on that memory
    _, grid, transport, tables, tuned = torch_torus.group_config(values, 8, hosts)
    assert tuned is None and transport == "shm"
    assert tables == resolve_tables(values, 8, grid, "shm", machine=faster, hosts=hosts)
    assert tables["allreduce"] != resolve_tables(values, 8, grid, "shm", hosts=hosts)["allreduce"]
    # Over TCP the memory plays no part.
    tcp = config.resolve(None, environ={"TORUS_TUNING_FILE": path, "TORUS_TRANSPORT": "tcp"})
    assert torch_torus.group_config(tcp, 8, hosts)[3] == resolve_tables(tcp, 8, grid, "tcp", hosts=hosts)


def test_user_rules_win_over_the_tuned_table():
    values = config.resolve(None, environ={"TORUS_ALLREDUCE": "direct:0-1000"})
    tuned = tuning.rules_from_measurements(SIZES, TIMES)
    table = resolve_tables(values, 4, choose_grid(4, ["h"] * 4, None), tuned_allreduce=tuned)["allreduce"]
    assert [str(r) for r in table] == ["direct:0-1000", "recursive_doubling:1001-262144",
                                      "rabenseifner:262145-4194304", "ring:4194305-max"]


def write_json(tmp_path, document):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(document) if not isinstance(document, str) else document)
    return str(path)


def valid_document(**changes):
    entry = tuning.make_entry(layout_of(4), SIZES, TIMES, {})
    document = {"format": tuning.FORMAT, "version": tuning.VERSION, "entries": [entry]}
    document.update(changes)
    return document


def test_other_version_is_refused_naming_variable_file_and_versions(tmp_path):
    path = write_json(tmp_path, valid_document(version=tuning.VERSION + 1))
    with pytest.raises(ConfigError) as error:
        tuning.tuned_allreduce(path, ["h"] * 4, None, "shm")
    message = str(error.value)
    assert "TORUS_TUNING_FILE" in message and path in message
    assert f"version {tuning.VERSION + 1}" in message and f"reads version {tuning.VERSION}" in message
    # Nor is it overwritten by a new tuning run: the user decides.
    with pytest.raises(ConfigError, match="version"):
        tuning.write(path, tuning.make_entry(layout_of(4), SIZES, TIMES, {}))


def bad_entry(**changes):
    entry = tuning.make_entry(layout_of(4), SIZES, TIMES, {})
    entry.update(changes)
    return valid_document(entries=[entry])


@pytest.mark.parametrize("document, needle", [
    ("{not json", "is not JSON"),
    ({"entries": []}, "is not a tuning file"),
    (valid_document(entries={}), "no \"entries\" list"),
    (bad_entry(world_size="four"), "entry 0 lacks a valid world_size"),
    (bad_entry(ranks_per_host=[2, 1]), "do not add up to world_size 4"),
    (bad_entry(transport="infiniband"), "transport 'infiniband' is none of tcp, shm, shm+tcp"),
    (bad_entry(allreduce="ring:0-100;warp:101-max"), "unknown algorithm 'warp'"),
    (bad_entry(allreduce="ring:0-100;direct:200-max"), "does not cover every size"),
])
def test_damaged_file_names_variable_file_and_problem(tmp_path, document, needle):
    path = write_json(tmp_path, document)
    with pytest.raises(ConfigError) as error:
        tuning.read(path)
    assert f"TORUS_TUNING_FILE={path!r}" in str(error.value) and needle in str(error.value)


def test_missing_file_is_an_error_at_group_creation(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        tuning.tuned_allreduce(str(tmp_path / "absent.json"), ["h"] * 4, None, "shm")


def test_tuned_table_only_uses_applicable_algorithms():
    # The tuner measures exactly what auto may choose for the group.
    assert "torus" in allreduce_candidates(choose_grid(4, ["h"] * 4, None))
    assert "torus" not in allreduce_candidates(choose_grid(5, ["h"] * 5, None))


# --- a real group takes the table of a matching entry --------------------------------------

def _case_group_takes_tuned_table(ctx, path, expected):
    import torch_torus

    group = ctx.new_group(list(range(ctx.world_size)), pg_options=ctx.pg_options(tuning_file=path))
    got = {size: torch_torus.algorithm_for("allreduce", size, group) for size in expected}
    problems = [f"algorithm_for(allreduce, {s}) = {got[s]}, expected {a}" for s, a in expected.items() if got[s] != a]
    try:
        ctx.new_group(list(range(ctx.world_size)), pg_options=ctx.pg_options(tuning_file=path + ".absent"))
        problems.append("a group was created with a missing tuning file")
    except ValueError as error:
        if "TORUS_TUNING_FILE" not in str(error):
            problems.append(f"missing-file error does not name the variable: {first_line(error)}")
    dist.barrier(group=group)
    return problems


def test_group_takes_tuned_table(backend, tmp_path):
    expectations.skip_if_not_applicable(backend, "torus.algorithm")
    path = str(tmp_path / "tuning.json")
    # The entry is for the transport the group runs over (torus+tcp, torus+shm).
    tuning.write(path, tuning.make_entry(layout_of(4, transport=backend.partition("+")[2]), SIZES, TIMES, {}))
    expected = {0: "recursive_doubling", 256 << 10: "recursive_doubling", (256 << 10) + 1: "rabenseifner",
                4 << 20: "rabenseifner", 64 << 20: "ring"}
    harness.check(backend, 4, _case_group_takes_tuned_table, path, expected)
