"""TORUS_* settings given bad values (issue 5): every one must fail group creation with a
ConfigError naming the variable and the value; good ones must be accepted.

* A deterministic table of bad and good values per setting (config.SETTINGS is the single
  source of truth: a setting without rows here fails test_every_setting_has_fuzz_tables).
* A seeded fuzzer: random strings and mutations of good values, a few hundred per setting,
  in this one process. Each value is either accepted, and then renders back to text that parses
  to the same value and builds the C++ configuration of a group (torch_torus.group_config, the
  same code init runs), or refused with a ConfigError naming the variable; never another
  exception, never a slow parse.
* End to end through init_process_group with 2 ranks: bad values on both ranks, a bad value on
  one rank only (the other must fail at once naming it, not wait for its timeout), good values.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import socket
import time

import pytest

import harness
import torch_torus
from torch_torus import config, network, tuning
from torch_torus.config import SETTINGS, ConfigError, MAX_BYTES, shown

BY_NAME = {s.name: s for s in SETTINGS}
ALGORITHM_SETTINGS = [f"TORUS_{c.upper()}" for c in config.ALGORITHMS]
IFNAMES = [name for _, name in socket.if_nameindex()]

# ---------------------------------------------------------------------------- the tables

_RULE_BAD = [
    "", " ", "bogus", "ring,direct", "ring:10-5", "ring:0-8192;ring:100-200", "ring:0-100;direct:100-max",
    "ring0-100", "ring:0100", "ring:", ":0-100", "ring:-1-100", "ring:0--5", "ring:0-lots", "ring:max-max",
    "ring:0-99999999999999999999999", f"ring:0-{MAX_BYTES + 1}", "ring:0-18446744073709551616",
    "ring:0-99999999999G", "ring:1e3-max", "ring:0x10-max", "ring:+5-max", "ring:0-1.5K", "ring:0-4T",
    ";", ";;", "ring;direct", "ring:0-10;;direct", "ring:0-10 direct:11-max", "rïng",
    "ring:٠-١٠٠", "ring:0-１００", "ring\u200b", "\u3000ring:0-10;warp:11-max", "ring:0-10\x00", "ring\udcff",
    "auto;ring", "auto:0-10;auto:5-20",
]
BAD: dict[str, list[str]] = {
    "TORUS_ALLREDUCE": _RULE_BAD + ["one_shot:0-10;two_shot:5-max", "torus:0-max;ring:1-2", "binomial"],
    "TORUS_ALLGATHER": _RULE_BAD + ["torus", "rabenseifner:0-max", "one_shot"],
    "TORUS_REDUCE_SCATTER": _RULE_BAD + ["recursive_doubling", "two_shot:0-max"],
    "TORUS_BROADCAST": _RULE_BAD + ["ring", "direct:0-max"],
    "TORUS_BARRIER": _RULE_BAD + ["ring", "binomial:0-max", "flags"],
    "TORUS_TORUS_DIMS": ["4by2", "0x8", "8x0", "x", "4x", "x4", "4x2x1", "-2x-2", "2.0x2", "٢x٢", "２x２",
                         "99999999999x1", f"{1 << 31}x1", "2 2", "2*2", "2x2;", "2x2\x00", "\udcff"],
    "TORUS_TORUS_INNER": ["", "torus", "one_shot", "two_shot", "bogus", "ring:0-max", "ring;direct", "rïng",
                          "ring\x00", "\udcff"],
    "TORUS_TRANSPORT": ["", "udp", "shm,tcp", "tcp;shm", "ｔｃｐ", "t c p", "tcp\x00", "infiniband", "\udcff"],
    "TORUS_OFI_PROVIDER": ["tcp ofi", "tcp\x00", "prov/../x", "ｔｃｐ", "\udcff", "a,b", "v\nerbs"],
    "TORUS_OFI_RMA_BYTES": ["", "-1", "autox", "1Q", "１K", "2048G", "nan"],
    "TORUS_HOST_ID": ["host\x00a", "a\nb", "\x07", "host\udcff", "tab\there"],
    "TORUS_CHUNK_BYTES": ["", " ", "0", "0K", "-5", "-1K", "lots", "1.5M", "1e6", "0x100", "+4096", "4T",
                          "4 MB extra", "K", "KiB", "99999999999999999999999", "99999999999G", "1025G",
                          str(1 << 63), str(1 << 64), "٥١٢", "５１２", "512\x00", "512K\u200b", "\udcff"],
    "TORUS_EAGER_BYTES": ["", " ", "-1", "-1K", "lots", "0.5M", "1e6", "0x100", "4T", "1025G", "K", str(1 << 64),
                          "٥١٢", "512K\u200b", "\udcff"],
    "TORUS_EAGER_WINDOW": ["", "-4M", "many", "4 MB extra", "2000G", "4M\x00", "\udcff"],
    "TORUS_INLINE_BYTES": ["", "-1M", "lots", "1 MB extra", "2000G", "1M\x00", "\udcff"],
    "TORUS_SOCKET_IFNAME": ["no-such-if0", "lo;eth0", "lo\x00", "\udcff", "l" * 300, "*"],
    "TORUS_TUNING_FILE": ["/no/such/file.json", "/", "/dev/null", "/dev/zero", "/proc", "a\x00b", "\x07",
                          "file\udcff"],
    "TORUS_LINK_BANDWIDTH": ["", " ", "fast", "0gbit", "-1gbit", "10", "10g", "10gb", "10Gb/s", "1e9bit", "gbit",
                             "10 gbit/h", "0x10gbit", "0B/s", "١gbit", "\x00"],
    "TORUS_LINK_LATENCY": ["", "soon", "20", "-1us", "1h", "us", "1e-3s", "20 us us", "٢us", "\x00"],
    "TORUS_LOG_LEVEL": ["", "loud", "error", "warning", "2", "INFO!", "info,debug", "ｉｎｆｏ", "\x00",
                        "\udcff"],
    "TORUS_DEVICE_STALL_TIMEOUT": ["", "0", "30", "-1s", "0.5ms", "2d", "soon", "1e3s", "٣s", "\x00"],
    "TORUS_HOST_DEVICE": ["", "yes", "1", "on:x", "stall", "stall:", "stall: ", "fail", "fail:copy",
                          "stall:a\x00", "stall:ü", "\udcff"],
    "TORUS_TRACE_BUFFER": ["", "-1", "1e3", "2k", "1000001", "off", " ", "٣", "\x00"],
    "TORUS_SHARED_TENSOR_CACHE": ["", " ", "-1", "-1G", "autox", "lots", "1.5G", "1e9", "2000G", "1G\x00", "١G",
                                  "\udcff"],
    "TORUS_TRACE_DIR": ["/tmp/a\x00b", "\udcff", "dir\nname"],
    "TORUS_WAIT": ["", "spin", "sleep", "pause,yield", "ｐａｕｓｅ", "auto\x00", "\udcff"],
}
_RULE_GOOD = ["auto", "AUTO", " auto ", "auto:0-max", "auto:0-100;auto:101-200"]
GOOD: dict[str, list[str]] = {
    "TORUS_ALLREDUCE": _RULE_GOOD + list(config.ALGORITHMS["allreduce"]) + [
        "Ring", " ring ", "ring:0-max", "recursive_doubling:0-8192;torus:8193-1048576;ring:1048577-max",
        "ring:1M-max;direct:0-1023", "ring : 0 - 4K ;", "ring:0-max;", "one_shot:0-64K", f"ring:0-{MAX_BYTES}",
        "ring:0-18446744073709551615", "direct:5-5", "rabenseifner:0-1KiB;two_shot:1025-MAX"],
    "TORUS_ALLGATHER": _RULE_GOOD + ["ring", "direct", "direct:0-64K;ring:65537-max"],
    "TORUS_REDUCE_SCATTER": _RULE_GOOD + ["ring", "DIRECT", "ring:0-1M"],
    "TORUS_BROADCAST": _RULE_GOOD + ["binomial", "chain", "binomial:0-1M;chain:1048577-max"],
    "TORUS_BARRIER": _RULE_GOOD + ["shared_memory", "dissemination", " Dissemination ", "dissemination:0-max"],
    "TORUS_TORUS_DIMS": ["", " ", "2x2", "4X1", "1x4", " 2 x 2 "],
    "TORUS_TORUS_INNER": list(config.TORUS_INNER_ALGORITHMS) + [" Ring "],
    "TORUS_TRANSPORT": ["auto", "tcp", "shm", " TCP ", "ofi", "shm+ofi"],
    "TORUS_OFI_PROVIDER": ["", "tcp", "tcp;ofi_rxm", " verbs ", "psm3"],
    "TORUS_OFI_RMA_BYTES": ["auto", " AUTO ", "0", "256K", "1M"],
    "TORUS_HOST_ID": ["", "node17", "node17|rack3", " padded ", "höst-ü", "主机"],
    "TORUS_CHUNK_BYTES": ["512K", "4096", "1M", "1m", "64KiB", "2g", "1 K", " 8192 ", "1024G", "1"],
    "TORUS_EAGER_BYTES": ["512K", "0", "1", "64KiB", " 1M ", "1024G"],
    "TORUS_EAGER_WINDOW": ["4M", "0", "64K", "1g", " 8192 "],
    "TORUS_INLINE_BYTES": ["1M", "0", "64K", "1g", " 8192 ", "max", " MAX "],
    "TORUS_SOCKET_IFNAME": ["", " "] + (["lo"] if "lo" in IFNAMES else []),
    "TORUS_TUNING_FILE": [""],  # a real file is added by the tuning_file fixture
    "TORUS_LINK_BANDWIDTH": ["10gbit", "1Gbit/s", "300mbit", "1.5gbit", " 100gbit ", "25gbitps", "800kbit",
                             "1.25GB/s", "117MB/s"],
    "TORUS_LINK_LATENCY": ["20us", "1.5ms", "0", "2s", " 5ns ", "0.25ms"],
    "TORUS_LOG_LEVEL": ["warn", "info", "debug", "INFO", " debug "],
    "TORUS_DEVICE_STALL_TIMEOUT": ["30s", "1ms", "2.5s", " 10s ", "86400s", "500ms"],
    "TORUS_HOST_DEVICE": ["off", "on", "ON", " on ", "stall:ready", "stall:copy into the arena", "fail:enter"],
    "TORUS_TRACE_BUFFER": ["0", "2000", " 16 ", "1000000"],
    "TORUS_SHARED_TENSOR_CACHE": ["auto", " AUTO ", "0", "64K", "1G", " 2g ", "1024G"],
    "TORUS_TRACE_DIR": ["", "/tmp/torus traces", "traces", "/tmp/ü"],
    "TORUS_WAIT": ["auto", "pause", "yield", " PAUSE ", "Yield"],
}


def _tuning_file(tmp_dir: str) -> str:
    path = os.path.join(tmp_dir, "tuning.json")
    entry = {"world_size": 4, "grid": [2, 2], "ranks_per_host": [4], "transport": "shm",
             "allreduce": "recursive_doubling:0-65535;ring:65536-max"}
    with open(path, "w") as f:
        json.dump({"format": tuning.FORMAT, "version": tuning.VERSION, "entries": [entry]}, f)
    return path


@pytest.fixture(scope="module")
def tuning_file(tmp_path_factory):
    return _tuning_file(str(tmp_path_factory.mktemp("tuning")))


# ------------------------------------------------------------------------ what we check

# Group layouts the accepted values must build for (or be refused naming the variable):
# 4 ranks on one host (a 2x2 grid, shared memory), 6 ranks on two hosts (rows per host, tcp).
LAYOUTS = [(4, ["h"] * 4), (6, ["a", "a", "a", "b", "b", "b"])]


def outcome(name: str, value: str) -> str:
    """'accepted', 'refused', or a problem string."""
    setting = BY_NAME[name]
    started = time.monotonic()
    try:
        values = config.resolve(None, environ={name: value})
    except ConfigError as error:
        return _refusal(name, value, error, started)
    except Exception as error:  # noqa: BLE001 - exactly what the test is for
        return f"{name}={value!r}: raised {type(error).__name__} (not ConfigError): {error}"
    parsed = values[setting.option]
    rendered = setting.render(parsed)
    try:
        again = config.resolve(None, environ={name: rendered})[setting.option]
    except Exception as error:  # noqa: BLE001
        return f"{name}={value!r} parsed to {parsed!r}, rendered {rendered!r}, which fails: {error}"
    if again != parsed:
        return f"{name}={value!r} parsed to {parsed!r}; rendered {rendered!r} parses to {again!r}"
    try:
        if setting.option == "socket_ifname":
            network.local_address(parsed)
        tuning = torch_torus.read_tuning(parsed) if setting.option == "tuning_file" and parsed else None
        for size, hosts in LAYOUTS:
            try:
                torch_torus.group_config(values, size, hosts, tuning=tuning)
            except ConfigError as error:
                if name not in str(error):
                    return f"{name}={value!r}: group of {size} refused without naming {name}: {error}"
    except ConfigError as error:
        return _refusal(name, value, error, started, later=True)
    except Exception as error:  # noqa: BLE001
        return f"{name}={value!r} (parsed {parsed!r}) broke the group configuration: {type(error).__name__}: {error}"
    return _slow(name, value, started) or "accepted"


def _refusal(name, value, error, started, later=False) -> str:
    text = str(error)
    if name not in text:
        return f"{name}={value!r}: the error does not name the variable: {text}"
    if not later and shown(value) not in text:
        return f"{name}={value!r}: the error does not show the value: {text}"
    return _slow(name, value, started) or "refused"


def _slow(name, value, started) -> str:
    elapsed = time.monotonic() - started
    return f"{name}={value!r} took {elapsed:.2f}s to judge" if elapsed > 0.5 else ""


def test_every_setting_has_fuzz_tables():
    names = {s.name for s in SETTINGS}
    assert set(BAD) == names and set(GOOD) == names, (
        f"tests/test_config_fuzz.py tables are missing {sorted(names - set(BAD) - set(GOOD))} "
        f"or list unknown {sorted((set(BAD) | set(GOOD)) - names)}")


@pytest.mark.parametrize("name", list(BAD))
def test_bad_values_are_refused_naming_variable_and_value(name):
    problems = []
    for value in BAD[name]:
        result = outcome(name, value)
        if result != "refused":
            problems.append(result if result != "accepted" else f"{name}={value!r} was accepted")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", list(GOOD))
def test_good_values_are_accepted(name, tuning_file):
    values = GOOD[name] + ([tuning_file, f" {tuning_file} "] if name == "TORUS_TUNING_FILE" else [])
    problems = [f"{r}" if r != "refused" else f"{name}={v!r} was refused" for v in values
                for r in [outcome(name, v)] if r != "accepted"]
    assert not problems, "\n".join(problems)


def test_options_values_of_any_type_are_judged_like_text():
    """pg_options carry Python values: ints are fine where text of them is, anything else is
    refused with a ConfigError naming the keyword, never a TypeError."""
    assert config.resolve(config.Options(chunk_bytes=1 << 20), {})["chunk_bytes"] == 1 << 20
    assert config.resolve(config.Options(tuning_file=5), {})["tuning_file"] == "5"  # read at init
    for option, value in [("chunk_bytes", -1), ("chunk_bytes", 1.5), ("chunk_bytes", None),
                          ("torus_dims", (2, 2)), ("transport", b"tcp"), ("host_id", "\x00"),
                          ("allreduce", ["ring"]), ("chunk_bytes", 1 << 70)]:
        with pytest.raises(ConfigError, match=rf"Options\({option}="):
            config.resolve(config.Options(**{option: value}), {})


# --------------------------------------------------------------------------- the fuzzer

ALPHABET = ("abcdefghijklmnopqrstuvwxyzKMGBXx" "0123456789" "0123456789" ":;-_,. " " \t\n|*/+=!"
            "\x00\x07\x7f\u00e9\u0130\u0131\u212a\u0660\uff11\u200b\u3000\udcff")
SEEDS = 300  # values per setting


def _mutate(rng: random.Random, text: str) -> str:
    choice = rng.randrange(10)
    pos = rng.randrange(len(text) + 1)
    if choice == 0 and text:  # delete a character
        return text[:pos] + text[pos + 1:]
    if choice == 1:  # insert one
        return text[:pos] + rng.choice(ALPHABET) + text[pos:]
    if choice == 2 and text:  # replace one
        return text[:pos] + rng.choice(ALPHABET) + text[pos + 1:]
    if choice == 3:  # a huge number somewhere
        return text[:pos] + "9" * rng.randrange(15, 40) + text[pos:]
    if choice == 4:  # doubled, as a rule list or not
        return text + rng.choice([";", "", ":", "-", "x"]) + text
    if choice == 5:  # case and whitespace
        return rng.choice([str.upper, str.lower, str.title, lambda s: f" \t{s}\n "])(text)
    if choice == 6 and "-" in text:  # swap a range's bounds
        head, _, tail = text.rpartition(":")
        lo, _, hi = tail.partition("-")
        return f"{head}:{hi}-{lo}"
    if choice == 7:  # a suffix
        return text + rng.choice(["K", "M", "G", "T", "KiB", "iB", "B", "k", "max", "-max", "x2"])
    if choice == 8:  # a sign
        return rng.choice(["-", "+", "0", "--"]) + text
    return text[: pos]  # truncated


def fuzz_values(name: str, seed: int) -> list[str]:
    rng = random.Random(f"{seed}:{name}")
    good = GOOD[name] + BAD[name][:5]
    out = []
    for i in range(SEEDS):
        if i % 3 == 0:
            out.append("".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 24))))
        else:
            text = rng.choice(good)
            for _ in range(rng.randrange(1, 4)):
                text = _mutate(rng, text)
            out.append(text)
    return out


@pytest.mark.parametrize("name", [s.name for s in SETTINGS])
def test_fuzz(name):
    seed = int(os.environ.get("TORUS_FUZZ_SEED", "5"))
    counts = {"accepted": 0, "refused": 0}
    problems = []
    for value in fuzz_values(name, seed):
        result = outcome(name, value)
        if result in counts:
            counts[result] += 1
        else:
            problems.append(result)
    assert not problems, f"seed {seed} ({counts}):\n" + "\n".join(problems[:30])
    # Both kinds happen, or the fuzzer is not exploring.
    assert counts["refused"] > 0, counts
    assert counts["accepted"] > 0 or name in ("TORUS_SOCKET_IFNAME", "TORUS_TUNING_FILE"), counts


# ---------------------------------------------------------------------- end to end, 2 ranks

E2E = {  # attempt -> environment by rank ("all": every rank)
    "bad chunk": {"all": {"TORUS_CHUNK_BYTES": "12Q"}},
    "overlapping rules": {"all": {"TORUS_ALLREDUCE": "ring:0-8192;ring:100-200"}},
    "overflowing chunk": {"all": {"TORUS_CHUNK_BYTES": "99999999999999999999999G"}},
    "grid for 9": {"all": {"TORUS_TORUS_DIMS": "3x3"}},  # well formed; refused for this group of 2
    "bad on rank 1 only": {1: {"TORUS_LOG_LEVEL": "loud"}},
    "good": {"all": {"TORUS_CHUNK_BYTES": " 64KiB ", "TORUS_ALLREDUCE": "recursive_doubling:0-1K;ring:1025-max",
                     "TORUS_LOG_LEVEL": "WARN", "TORUS_TRANSPORT": " TCP ", "TORUS_HOST_ID": "node-ü"}},
}


def _case_init_attempts(ctx, attempts: dict, pg_timeout_s: float):
    """init_process_group once per attempt, with that attempt's environment on this rank; what
    happened, and how long it took. A refused init leaves no group behind, so the next attempt
    (at a rendezvous file of its own) starts clean."""
    import torch
    import torch.distributed as dist

    outcomes = {}
    base = dict(os.environ)
    for tag, env_by_rank in attempts.items():
        os.environ.clear()
        os.environ.update(base)
        os.environ.update(env_by_rank.get(ctx.rank, env_by_rank.get("all", {})))
        started = time.monotonic()
        try:
            ctx.init_process_group(init="file", tag=f"-{len(outcomes)}",
                                   timeout=datetime.timedelta(seconds=pg_timeout_s))
        except Exception as error:  # noqa: BLE001
            outcomes[tag] = {"raised": type(error).__name__, "message": str(error),
                             "seconds": time.monotonic() - started}
            continue
        t = torch.full((3,), float(ctx.rank + 1))
        dist.all_reduce(t)
        dist.destroy_process_group()
        outcomes[tag] = {"raised": None, "result": t.tolist(), "seconds": time.monotonic() - started}
    return outcomes


@pytest.fixture(scope="module")
def e2e():
    """Every attempt, on one pair of fresh processes (starting processes is the slow part)."""
    return harness.run_job("torus+tcp", 2, _case_init_attempts, E2E, 60.0, init="none", timeout=120)


@pytest.mark.parametrize("attempt", ["bad chunk", "overlapping rules", "overflowing chunk", "grid for 9"])
def test_init_refuses_bad_value_on_every_rank(e2e, attempt):
    (name, value), = E2E[attempt]["all"].items()
    for rank in range(2):
        r = e2e[rank][attempt]
        assert r["raised"] == "ConfigError", f"rank {rank}: {r}"
        assert name in r["message"], f"rank {rank}: {r['message']}"
        if attempt != "grid for 9":  # refused after parsing: shown as rows x columns
            assert shown(value) in r["message"], f"rank {rank}: {r['message']}"


def test_init_bad_value_on_one_rank_fails_the_other_at_once(e2e):
    """Rank 1 alone has a bad value: it refuses, and rank 0 fails at once naming rank 1 and the
    variable, instead of waiting in the store for the group's timeout (60 s here)."""
    r0, r1 = e2e[0]["bad on rank 1 only"], e2e[1]["bad on rank 1 only"]
    assert r1["raised"] == "ConfigError" and "TORUS_LOG_LEVEL='loud'" in r1["message"], r1
    assert r0["raised"] == "ConfigError", r0
    assert "rank 1" in r0["message"] and "TORUS_LOG_LEVEL='loud'" in r0["message"], r0
    assert r0["seconds"] < 20, f"rank 0 took {r0['seconds']:.1f}s to notice"


def test_init_accepts_good_values(e2e):
    for rank in range(2):
        r = e2e[rank]["good"]
        assert r["raised"] is None, f"rank {rank}: {r}"
        assert r["result"] == [3.0, 3.0, 3.0], f"rank {rank}: {r}"
