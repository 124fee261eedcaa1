"""Settings: one source of truth, errors that name the variable and value."""

import pytest

from torch_torus import config, units


def test_defaults_resolve():
    values = config.resolve(None, environ={})
    assert values["allreduce"] == ()  # auto
    assert values["chunk_bytes"] == 512 * 1024
    assert values["log_level"] == "warn"
    assert values["socket_ifname"] == ""
    assert values["link_bandwidth"] == 10e9 / 8  # 10 Gbit/s, in bytes per second
    assert values["link_latency"] == 20e-6


@pytest.mark.parametrize("text, expected", [("10gbit", 1.25e9), ("1Gbit/s", 1.25e8), ("300mbit", 3.75e7),
                                            ("1.5gbit", 1.875e8), ("100kbit", 12500.0), ("25gbitps", 3.125e9),
                                            ("1.25GB/s", 1.25e9), ("117MB/s", 1.17e8), (" 2kB/s ", 2000.0)])
def test_parse_rate_reads_bits_or_bytes_and_returns_bytes_per_second(text, expected):
    assert units.parse_rate(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["10", "10g", "10gb", "10Gb/s", "1e9bit", "-1gbit", "0gbit", "0B/s", "١٠gbit",
                                  "10 g bit", "gbit"])
def test_parse_rate_refuses_ambiguous_or_malformed_rates(text):
    with pytest.raises(ValueError, match="10gbit, 100mbit|greater than zero"):
        units.parse_rate(text)


def test_a_rate_without_unit_takes_the_unit_the_caller_names():
    assert units.parse_rate("117M", default_unit="B/s") == 117e6
    assert units.parse_rate("12.5G", default_unit="B/s") == 12.5e9
    assert units.parse_rate("1g", default_unit="bit/s") == 1.25e8
    assert units.parse_rate("1gbit", default_unit="B/s") == 1.25e8  # a unit given wins


@pytest.mark.parametrize("text, expected", [("20us", 20e-6), ("1.5ms", 1.5e-3), ("0", 0.0), ("2s", 2.0),
                                            ("500ns", 5e-7), (" 5NS ", 5e-9), (".5ms", 5e-4)])
def test_parse_duration(text, expected):
    assert units.parse_duration(text) == pytest.approx(expected)


def test_a_duration_without_unit_needs_the_caller_to_name_one():
    with pytest.raises(ValueError, match="20us, 1.5ms"):
        units.parse_duration("0.4")
    assert units.parse_duration("0.4", default_unit="s") == 0.4
    assert units.parse_duration("4", default_unit="us") == 4e-6


@pytest.mark.parametrize("text, expected", [("524288", 524288), ("512K", 524288), ("1M", 1 << 20),
                                            ("2g", 2 << 30), ("64KiB", 65536), ("4 kb", 4096), (" 1G ", 1 << 30)])
def test_parse_size(text, expected):
    assert units.parse_size(text) == expected


@pytest.mark.parametrize("text", ["1.5M", "4T", "-5", "1e6", "0x100", "٥١٢", "K", ""])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="byte count"):
        units.parse_size(text)
    with pytest.raises(ValueError, match="more than the largest allowed, 1023"):
        units.parse_size("1K", limit=1023)


@pytest.mark.parametrize("value", [1.25e9, 37500000.0, 1e3 / 8, 0.1])
def test_rates_and_durations_render_back(value):
    assert units.parse_rate(units.render_bit_rate(value)) == value
    assert units.parse_duration(units.render_duration(value)) == value


def test_parsers_as_argparse_types_show_the_value():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=units.argument(units.parse_size))
    assert parser.parse_args(["--size", "4K"]).size == 4096
    with pytest.raises(argparse.ArgumentTypeError, match=r"'lots': expected a byte count"):
        units.argument(units.parse_size)("lots")


@pytest.mark.parametrize("name, value, allowed", [
    ("TORUS_ALLREDUCE", "bogus", "auto, ring, torus, direct, recursive_doubling, rabenseifner"),
    ("TORUS_ALLREDUCE", "ring:0-100;direct:50-max", "overlap"),
    ("TORUS_ALLREDUCE", "ring:100-5", "reversed"),
    ("TORUS_ALLREDUCE", "ring:0-lots", "byte counts"),
    ("TORUS_ALLREDUCE", "ring:0-100;warp:101-max", "unknown algorithm 'warp'"),
    ("TORUS_ALLREDUCE", "ring 0-100", "unknown algorithm"),
    ("TORUS_ALLGATHER", "torus", "auto, ring, direct"),
    ("TORUS_REDUCE_SCATTER", "rabenseifner", "auto, ring, direct"),
    ("TORUS_BROADCAST", "ring", "auto, binomial, chain"),
    ("TORUS_TORUS_DIMS", "4by2", "<rows>x<columns>"),
    ("TORUS_TORUS_DIMS", "0x8", "at least 1"),
    ("TORUS_TORUS_INNER", "torus", "ring, direct, recursive_doubling, rabenseifner"),
    ("TORUS_CHUNK_BYTES", "0", "greater than zero"),
    ("TORUS_CHUNK_BYTES", "lots", "byte count"),
    ("TORUS_CHUNK_BYTES", "-5", "byte count"),
    ("TORUS_LOG_LEVEL", "loud", "warn, info, debug"),
    ("TORUS_SOCKET_IFNAME", "no-such-if0", "no such network interface"),
    ("TORUS_LINK_BANDWIDTH", "10g", "10gbit, 100mbit"),
    ("TORUS_LINK_BANDWIDTH", "0gbit", "greater than zero"),
    ("TORUS_LINK_LATENCY", "20", "20us, 1.5ms"),
    ("TORUS_LINK_LATENCY", "-1ms", "20us, 1.5ms"),
])
def test_bad_environment_value_names_variable_value_and_allowed(name, value, allowed):
    with pytest.raises(config.ConfigError) as error:
        config.resolve(None, environ={name: value})
    message = str(error.value)
    assert name in message and repr(value) in message and allowed in message


def test_options_win_over_environment():
    values = config.resolve(config.Options(chunk_bytes="1M"), environ={"TORUS_CHUNK_BYTES": "4K"})
    assert values["chunk_bytes"] == 1 << 20


def test_bad_option_names_keyword():
    with pytest.raises(config.ConfigError, match="chunk_bytes"):
        config.resolve(config.Options(chunk_bytes="nope"), environ={})
    with pytest.raises(config.ConfigError, match="unknown setting.*chunk_size"):
        config.Options(chunk_size=5)
