"""Every TORUS_* setting, defined once: name, default, parser and documentation.

Settings are read when a process group is created. A value passed in code
(``torch_torus.Options(chunk_bytes=...)`` as ``pg_options``) wins over the environment. A bad
value fails group creation with an error naming the variable, the value and what is allowed.
The docs' settings table (docs/algorithms.md) is generated from this module (``markdown_table()``)
and a test checks that the two agree.

Values are ASCII where they are numbers or names (digits from other scripts are refused, not
read), may carry surrounding whitespace, and are empty only where the default is empty (there,
empty means automatic). Each setting's ``render`` writes a parsed value back as text that parses
to the same value (tests/test_config_fuzz.py checks it for thousands of values).
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from . import _C, algorithms
from .units import parse_duration, parse_rate, parse_size, render_bit_rate, render_duration

# Algorithms per collective, as TORUS_<COLLECTIVE> names them (from the C++ catalog); "auto" (the
# default) lets the group choose per call: a cost model for allreduce, size thresholds for the others.
ALGORITHMS: dict[str, tuple[str, ...]] = algorithms.CHOOSABLE
TORUS_INNER_ALGORITHMS = algorithms.TORUS_INNER
SHARED_MEMORY_ALGORITHMS = algorithms.SHARED_MEMORY
TRANSPORTS = ("auto", "tcp", "shm", "ofi", "shm+ofi")
LOG_LEVELS = ("warn", "info", "debug")
MAX_BYTES = (1 << 64) - 1  # "max" in a rule: no upper bound
DEFAULT_CHUNK_BYTES = algorithms.DEFAULT_CHUNK_BYTES
DEFAULT_EAGER_BYTES = algorithms.DEFAULT_EAGER_BYTES
DEFAULT_EAGER_WINDOW = algorithms.DEFAULT_EAGER_WINDOW
DEFAULT_INLINE_BYTES = algorithms.DEFAULT_INLINE_BYTES
# The largest chunk: far beyond any useful pipelining, and small enough that the algorithms'
# segment arithmetic (ranks x chunks in flight x chunk bytes) cannot overflow 64 bits.
MAX_CHUNK_BYTES = 1 << 40
MAX_DIM = (1 << 31) - 1  # ranks are C ints
# A value's repr in an error is cut to this many characters.
_SHOWN = 200


class ConfigError(ValueError):
    """A TORUS_* setting (or its Options counterpart) has a value we cannot use."""


def _positive_bytes(text: str) -> int:
    value = parse_size(text, MAX_CHUNK_BYTES)
    if value <= 0:
        raise ValueError("must be greater than zero")
    return value


def _byte_count(text: str) -> int:
    return parse_size(text, MAX_CHUNK_BYTES)


def _render_size(value: int) -> str:
    for shift, suffix in ((30, "G"), (20, "M"), (10, "K")):
        if value and value % (1 << shift) == 0:
            return f"{value >> shift}{suffix}"
    return str(value)


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = str(text).strip().lower()
        if value not in choices:
            raise ValueError("allowed: " + ", ".join(choices))
        return value

    return parse


MAX_TRACE_BUFFER = 1_000_000


def _trace_buffer(text: str) -> int:
    value = str(text).strip()
    if not re.fullmatch(r"[0-9]+", value) or int(value) > MAX_TRACE_BUFFER:
        raise ValueError(f"expected a number of calls from 0 (off) to {MAX_TRACE_BUFFER}")
    return int(value)


def _provider_name(text: str) -> str:
    """A libfabric provider name as fi_info lists it ("tcp", "verbs", "tcp;ofi_rxm"); empty:
    libfabric's choice."""
    value = str(text).strip()
    if value and not re.fullmatch(r"[A-Za-z0-9_;.-]+", value):
        raise ValueError("a libfabric provider name as `fi_info -l` lists it (tcp, verbs, shm, "
                         "tcp;ofi_rxm, ...), or empty for libfabric's choice")
    return value


def _rma_bytes(text: str) -> int:
    """TORUS_OFI_RMA_BYTES: a size, or auto (-1: the provider's default)."""
    return -1 if str(text).strip().lower() == "auto" else _byte_count(text)


def _shared_tensor_cache(text: str) -> int:
    """TORUS_SHARED_TENSOR_CACHE: a size, or auto (-1: the peak of live shared tensor bytes)."""
    return -1 if str(text).strip().lower() == "auto" else _byte_count(text)


def _render_rma_bytes(value: int) -> str:
    return "auto" if value < 0 else _render_size(value)


def _inline_bytes(text: str) -> int:
    """TORUS_INLINE_BYTES: a size, or max (any size)."""
    return _size_bound(str(text), True, MAX_CHUNK_BYTES)


def _render_inline_bytes(value: int) -> str:
    return "max" if value == MAX_BYTES else _render_size(value)


def _interface_name(text: str) -> str:
    name = str(text).strip()
    names = [n for _, n in socket.if_nameindex()]
    if name and name not in names:
        raise ValueError("no such network interface here; available: " + ", ".join(names))
    return name


def _printable(what: str) -> Callable[[str], str]:
    """Free text (stripped; empty: automatic) that we print and hand to the store or the file
    system: printable characters that UTF-8 can encode (an environment variable holding bytes
    that are not UTF-8 reaches Python as lone surrogates)."""
    def parse(text: str) -> str:
        value = str(text).strip()
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{what} must be text that UTF-8 can encode") from None
        if not value.isprintable():
            raise ValueError(f"{what} must not contain control characters")
        return value

    return parse


@dataclass(frozen=True)
class Rule:
    """Use `algorithm` for messages of lo..hi bytes (inclusive), as in oneCCL's CCL_ALLREDUCE."""

    algorithm: str
    lo: int
    hi: int

    def __str__(self) -> str:
        return f"{self.algorithm}:{self.lo}-{'max' if self.hi == MAX_BYTES else self.hi}"


def _size_bound(text: str, allow_max: bool, limit: int = MAX_BYTES) -> int:
    """A byte count up to `limit`, or (`allow_max`) 'max': no bound."""
    text = text.strip()
    if allow_max and text.lower() == "max":
        return MAX_BYTES
    return parse_size(text, limit)


def parse_rules(text: str, collective: str) -> tuple[Rule, ...]:
    """'ring' | 'auto' | '<name>:<lo>-<hi>;<name>:<lo>-max' -> rules sorted by lo.

    "auto" (alone) gives no rules: every size uses the group's automatic choice, as do sizes
    that the rules leave uncovered.
    """
    allowed = ALGORITHMS[collective]
    choices = "auto, " + ", ".join(allowed)
    text = str(text).strip()
    if text.lower() == "auto":
        return ()
    if ":" not in text and ";" not in text:
        name = text.lower()
        if name not in allowed:
            raise ValueError(f"unknown algorithm {name!r}; allowed: {choices}, or "
                             f"size rules such as '{allowed[0]}:0-8192;{allowed[-1]}:8193-max'")
        return (Rule(name, 0, MAX_BYTES),)
    rules = []
    for block in filter(None, (b.strip() for b in text.split(";"))):
        match = re.fullmatch(r"([A-Za-z_]+)\s*:\s*([^-\s]+)\s*-\s*(\S+)", block, re.ASCII)
        if not match:
            raise ValueError(f"rule {block!r} is not of the form <algorithm>:<lo>-<hi> "
                             "(bytes; hi may be 'max')")
        name = match.group(1).lower()
        if name not in allowed and name != "auto":
            raise ValueError(f"rule {block!r}: unknown algorithm {name!r}; allowed: {choices}")
        try:
            lo, hi = _size_bound(match.group(2), False), _size_bound(match.group(3), True)
        except ValueError:
            raise ValueError(f"rule {block!r}: sizes must be byte counts (suffixes K, M, G) up to "
                             f"{MAX_BYTES}, or 'max' for the upper bound") from None
        if lo > hi:
            raise ValueError(f"rule {block!r}: the range is reversed ({lo} > {hi})")
        rules.append(Rule(name, lo, hi))
    if not rules:
        raise ValueError("no rules given")
    rules.sort(key=lambda r: r.lo)
    for before, after in zip(rules, rules[1:]):
        if after.lo <= before.hi:
            raise ValueError(f"rules {before} and {after} overlap")
    return tuple(r for r in rules if r.algorithm != "auto")


def _rules_for(collective: str) -> Callable[[str], tuple[Rule, ...]]:
    return lambda text: parse_rules(text, collective)


def render_rules(rules: tuple[Rule, ...]) -> str:
    return ";".join(str(r) for r in rules) or "auto"


# The most a device phase may be given to stall: a day, far beyond any collective worth waiting for.
MAX_STALL_SECONDS = 86400.0


def _stall_bound(text: str) -> float:
    value = parse_duration(text)
    if not 0.001 <= value <= MAX_STALL_SECONDS:
        raise ValueError(f"must be from 1ms to {MAX_STALL_SECONDS:g}s")
    return value


def parse_host_device(text: str) -> str:
    """'off', 'on', or a fault for tests: 'stall:<step>' (the ready or done event, or every device
    phase whose step names contain <step>) or 'fail:enter'."""
    value = str(text).strip()
    kind, _, step = value.partition(":")
    kind = kind.lower()
    if kind in ("off", "on") and not step:
        return kind
    if kind == "fail" and step == "enter":
        return value
    if kind == "stall" and step.strip() and step.isprintable() and step.isascii():
        return f"stall:{step}"
    raise ValueError("allowed: off, on, stall:<step> (ready, done, or part of a device phase's name, "
                     "such as 'copy into the arena'), fail:enter")


def parse_dims(text: str) -> tuple[int, int] | None:
    """'' -> None (automatic); 'RxC' -> (R, C)."""
    text = str(text).strip().lower()
    if not text:
        return None
    match = re.fullmatch(r"(\d+)\s*x\s*(\d+)", text, re.ASCII)
    if not match or not all(1 <= int(match.group(i)) <= MAX_DIM for i in (1, 2)):
        raise ValueError(f"expected <rows>x<columns> with both at least 1 (and at most {MAX_DIM}), e.g. 8x4")
    return int(match.group(1)), int(match.group(2))


def render_dims(dims: tuple[int, int] | None) -> str:
    return f"{dims[0]}x{dims[1]}" if dims else ""


@dataclass(frozen=True)
class Setting:
    name: str  # the environment variable
    default: str
    parse: Callable[[str], Any]
    doc: str
    # A parsed value back to text that parses to it again.
    render: Callable[[Any], str] = str
    # Whether every rank of a group must hold the same value: the settings that change what a
    # collective computes, which peer it pairs with, or the protocol between two ranks. The ranks
    # compare them when they create a group (torch_torus.agreement); False: it may differ.
    shared: bool = True
    # The part of a shared value the ranks compare, where only that part must agree (default: all).
    agreed: Callable[[Any], Any] | None = None

    @property
    def option(self) -> str:
        """The keyword of torch_torus.Options that overrides this variable."""
        return self.name[len("TORUS_"):].lower()


SETTINGS: tuple[Setting, ...] = (
    *(
        Setting(
            f"TORUS_{collective.upper()}",
            "auto",
            _rules_for(collective),
            f"{collective} algorithm: auto, " + ", ".join(names) + ", or size rules "
            f"`<algorithm>:<lo>-<hi>;...` in bytes (`max`: no bound); uncovered sizes use auto.",
            render_rules,
        )
        for collective, names in ALGORITHMS.items()
    ),
    Setting(
        "TORUS_TORUS_DIMS",
        "",
        parse_dims,
        "Torus grid `<rows>x<columns>` (rows x columns = world size); empty: one row per host "
        "when every host has the same number (>1) of ranks and there are several hosts, else the "
        "most square factorization.",
        render_dims,
    ),
    Setting(
        "TORUS_TORUS_INNER",
        TORUS_INNER_ALGORITHMS[0],
        _one_of(TORUS_INNER_ALGORITHMS),
        "Allreduce algorithm of the torus's column phase: " + ", ".join(TORUS_INNER_ALGORITHMS) + ".",
    ),
    Setting(
        "TORUS_TRANSPORT",
        "auto",
        _one_of(TRANSPORTS),
        "How ranks move bytes: shm (shared memory, with single copies between processes where "
        "the kernel allows; every rank on one host), tcp, ofi (libfabric: the cluster's fabric "
        "through TORUS_OFI_PROVIDER; needs a build with libfabric), shm+ofi (shared memory inside "
        "each host, ofi between hosts), or auto: shm when all ranks share a host; across hosts, "
        "shared memory inside each host and tcp between hosts when some host holds several ranks, "
        "else tcp.",
    ),
    Setting(
        "TORUS_OFI_PROVIDER",
        "",
        _provider_name,
        "libfabric provider of the ofi transport (tcp, verbs, psm3, cxi, efa, shm, ...); empty: "
        "libfabric's first with tagged reliable-datagram endpoints (FI_PROVIDER narrows it). shm is "
        "for studying libfabric: a peer killed while it holds one of libfabric's spinlocks leaves "
        "the survivor spinning inside libfabric, beyond any timeout (transports.md); torus's own "
        "shared memory serves ranks of one host.",
    ),
    Setting(
        "TORUS_OFI_RMA_BYTES",
        "auto",
        _rma_bytes,
        "Over ofi, messages above this size go by RMA reads (the receiver reads the sender's "
        "registered buffer, no copy on either side) where the provider offers them; smaller ones, "
        "and all on providers without RMA, stream through bounce buffers. auto: 256K, but never "
        "on providers that carry RMA over their message sockets (tcp, udp, sockets, net), where "
        "the stream measured faster.",
        _render_rma_bytes,
    ),
    Setting(
        "TORUS_HOST_ID",
        "",
        _printable("a host identity"),
        "Identity of this rank's host; ranks with the same identity share a host. Empty: host "
        "name, boot id and network namespace together.",
        shared=False,
    ),
    Setting(
        "TORUS_CHUNK_BYTES",
        f"{DEFAULT_CHUNK_BYTES >> 10}K",
        _positive_bytes,
        "Largest message a pipelined algorithm sends at once (suffixes K, M, G; at most 1024G); the "
        "transfer of one chunk overlaps the reduction of the previous one.",
    ),
    Setting(
        "TORUS_EAGER_BYTES",
        _render_size(DEFAULT_EAGER_BYTES),
        _byte_count,
        "Largest message a rank sends before the receiver has posted its receive; larger ones "
        "wait in the sender's buffer until it has (as do all messages past TORUS_EAGER_WINDOW). 0: "
        "every non-empty message waits.",
        _render_size,
    ),
    Setting(
        "TORUS_EAGER_WINDOW",
        _render_size(DEFAULT_EAGER_WINDOW),
        _byte_count,
        "Most payload a rank holds per peer for messages it has not asked for yet (the bound on a "
        "receiver's memory when a sender runs ahead); a sender past it waits for the receive.",
        _render_size,
    ),
    Setting(
        "TORUS_INLINE_BYTES",
        _render_inline_bytes(DEFAULT_INLINE_BYTES),
        _inline_bytes,
        "Largest collective (bytes of its tensors) that runs on the calling thread when the caller "
        "waits for it at once (async_op=False) and none of the group's collectives is queued or "
        "running: no hand-off to the group's worker thread and back. max: any size. Larger ones, "
        "async_op=True and CUDA tensors go through the worker. 0: every collective does.",
        _render_inline_bytes,
        shared=False,
    ),
    Setting(
        "TORUS_WAIT",
        _C.WAIT_POLICIES[0],
        _one_of(_C.WAIT_POLICIES),
        "How a wait on shared memory spends its first 200 µs, before it sleeps. auto decides per "
        "wait: it pauses in place (the core stays the rank's) only on a thread whose caller waits "
        "for the collective, while the host's ranks have a core each in their current affinity and "
        "no more of the process's threads run callers' collectives than its share of the cores; it "
        "sleeps at once where a peer last waited on the same core, and once a pause found nothing "
        "for 50 µs or a yield lost the core for 50 µs; every other wait yields. pause: every wait "
        "pauses (ranks with cores of their own, as mpiexec's binding gives them). yield: every "
        "wait yields the core.",
        shared=False,
    ),
    Setting(
        "TORUS_SOCKET_IFNAME",
        "",
        _interface_name,
        "Network interface whose address the TCP transport uses (its first IPv4 address, else its "
        "first IPv6 one); empty: the address that routes to MASTER_ADDR, else the host name's address.",
        shared=False,
    ),
    Setting(
        "TORUS_TUNING_FILE",
        "",
        _printable("a file name"),
        "Tuning file written by `python -m torch_torus.tune`; auto takes its allreduce table when "
        "an entry matches the group (world size, torus grid, ranks per host, transport), else the cost model. "
        "Empty: the cost model. Its path may differ between ranks; the table the group takes from it may not.",
        shared=False,
    ),
    Setting(
        "TORUS_LINK_BANDWIDTH",
        "10gbit",
        parse_rate,
        "Rate of each host's network link, each direction, in bits (e.g. 10gbit, 100gbit, 1gbit) or "
        "bytes per second (1.25GB/s), for auto's "
        "cost model when a group spans several hosts: the bytes that cross a host's link, over "
        "this rate, bound each allreduce algorithm's time. One host: unused.",
        render_bit_rate,
    ),
    Setting(
        "TORUS_LINK_LATENCY",
        "20us",
        parse_duration,
        "Time a message takes from host to host (e.g. 20us, 2ms), charged per step of an allreduce "
        "in which some message crosses hosts, in auto's cost model. One host: unused.",
        render_duration,
    ),
    Setting(
        "TORUS_DEVICE_STALL_TIMEOUT",
        "30s",
        _stall_bound,
        "How long one phase of a collective on device tensors (the wait for the caller's stream, the "
        "arena exchange, an arena round's copy, barrier or reduction, a staging copy, the done event) "
        "may wait before it fails, naming the phase, its round and peer, and the rank; with "
        "TORUS_LOG_LEVEL=debug, a Work.wait() that has not returned half this long after its "
        "collective completed is reported.",
        render_duration,
        shared=False,
    ),
    Setting(
        "TORUS_HOST_DEVICE",
        "off",
        parse_host_device,
        "For testing the device path without a GPU: on runs collectives on CPU tensors through the "
        "host implementation of the device layer (CPU memory as device memory, arenas in POSIX "
        "shared memory), exactly as CUDA tensors run on a GPU; stall:<step> and fail:enter add a "
        "fault. off: CPU tensors take the host path. Every rank must agree on off or not; a fault "
        "may be one rank's alone.",
        agreed=lambda value: "off" if value == "off" else "on",
    ),
    Setting(
        "TORUS_TRACE_BUFFER",
        "2000",
        _trace_buffer,
        "How many of a group's last collectives and point-to-point calls its flight recorder keeps "
        "(what, issued by whom, how far each got), dumped when a collective times out or fails, when "
        "the group is aborted, and by torch_torus.dump_trace(); read by `python -m torch_torus.trace "
        "DIR`. 0: off.",
        shared=False,
    ),
    Setting(
        "TORUS_TRACE_DIR",
        "",
        _printable("a directory"),
        "Where the flight recorder's dumps go: one directory per group, `<group>-<epoch>`, with one "
        "`rank<r>.json` per rank; errors name it. Empty: `torus-trace-<uid>` in the system's "
        "temporary directory, one per user. The directory and the group's in it are created 0700 and "
        "must belong to the user; dumps never follow a link.",
        shared=False,
    ),
    Setting(
        "TORUS_SHARED_TENSOR_CACHE",
        "auto",
        _shared_tensor_cache,
        "Most bytes of freed shared tensors (allocate_tensor's CPU tensors of 64 KiB or more, in "
        "memfd segments peers map) the process keeps for reuse; past it, those freed longest ago go "
        "back to the system. auto: as many bytes as its shared tensors held at once at their peak "
        "(since torch_torus.empty_cache()), so a repeating workload such as FSDP2's reuses every "
        "buffer while the process holds at most twice its working set. 0: none kept. One limit per "
        "process: the latest group alive sets it; with no group left nothing is kept.",
        _render_rma_bytes,
        shared=False,
    ),
    Setting(
        "TORUS_LOG_LEVEL",
        "warn",
        _one_of(LOG_LEVELS),
        "warn: errors only; info: one line per group at creation, and each rank's device arenas; "
        "debug: one line per collective (and its device route).",
        shared=False,
    ),
)

_BY_OPTION = {s.option: s for s in SETTINGS}


class Options:
    """Settings given in code, passed as ``pg_options``; they win over TORUS_* variables.

    >>> dist.new_group(backend="torus", pg_options=torch_torus.Options(chunk_bytes="1M"))
    """

    def __init__(self, **settings: Any) -> None:
        unknown = sorted(set(settings) - set(_BY_OPTION))
        if unknown:
            raise ConfigError(
                f"torch_torus.Options: unknown setting(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(_BY_OPTION))}"
            )
        self.settings = dict(settings)

    def __repr__(self) -> str:
        return "Options(" + ", ".join(f"{k}={v!r}" for k, v in self.settings.items()) + ")"


def resolve(options: Options | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The value of every setting for a new group, keyed by option name."""
    environ = os.environ if environ is None else environ
    given = options.settings if isinstance(options, Options) else {}
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        if setting.option in given:
            raw, source = given[setting.option], f"torch_torus.Options({setting.option}=...)"
        else:
            raw, source = environ.get(setting.name, setting.default), setting.name
        try:
            values[setting.option] = setting.parse(raw if isinstance(raw, str) else str(raw))
        except ValueError as error:
            raise ConfigError(f"{source}={shown(raw)} is not valid: {error}") from None
    return values


def shown(value: Any) -> str:
    """repr(value) for an error message, cut short when long."""
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN - 5] + "...'"


def markdown_table() -> str:
    """The settings table of docs/algorithms.md (docs/generate_tables.py writes it there)."""
    rows = ["| Variable | Options keyword | Default | Same on every rank | Meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        default = f"`{s.default}`" if s.default else "(empty)"
        rows.append(f"| `{s.name}` | `{s.option}` | {default} | {'yes' if s.shared else 'may differ'} | {s.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
