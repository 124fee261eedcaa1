"""The settings every rank of a group must share, compared when the group is created.

A rank whose grid, transport, algorithm tables, chunk size or flow control differ from its peers'
would pair with the wrong peer or compute something else, silently or only at the timeout. So
before the transport connects, each rank publishes what it must agree on (config.SETTINGS marked
shared, and the algorithm tables it resolved, which a tuning file or the cost model's inputs
decide) and a digest of it; rank 0 reads the digests, and the records of one rank per distinct
digest only when they differ, and publishes a verdict that every other rank reads: a rank sets
two keys and reads one however large the group. A group whose ranks disagree fails on every rank,
naming each setting, each value and the ranks holding it.
"""

from __future__ import annotations

import hashlib
import json

from .config import SETTINGS, ConfigError, Rule, render_rules
from .topology import FAILED, describe_failures, failures_of
_VERDICT_KEY = "torus/settings/verdict"


def _digest_key(rank: int) -> str:
    return f"torus/settings/{rank}"


def _record_key(rank: int) -> str:
    return f"torus/settings/record/{rank}"


def shared_values(values: dict, tables: dict[str, tuple[Rule, ...]]) -> dict[str, str]:
    """What this rank must agree on with its peers: each shared setting's value (or the part of
    it that must agree) as text, then each collective's resolved algorithm table."""
    shared = {}
    for setting in SETTINGS:
        if setting.shared:
            value = values[setting.option]
            shared[setting.name] = str(setting.agreed(value)) if setting.agreed else setting.render(value)
    for collective, rules in tables.items():
        shared[f"the {collective} table"] = render_rules(rules)
    return shared


def describe_ranks(ranks) -> str:
    """[0, 1, 2, 4] -> 'ranks 0-2, 4'; [5] -> 'rank 5'."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in spans)
    return ("ranks " if len(ranks) > 1 else "rank ") + text


def disagreements(records: dict[tuple[int, ...], dict[str, str]]) -> list[str]:
    """What the ranks disagree on, one line per setting: `records` maps the ranks that published
    one record to it. The algorithm tables are named only when no setting differs (a setting
    that differs changes them too): then a tuning file or the cost model's inputs made them."""
    lines, tables = [], []
    names = list(next(iter(records.values())))
    for name in names:
        holders: dict[str, list[int]] = {}
        for ranks, record in records.items():
            holders.setdefault(record.get(name, "(none)"), []).extend(ranks)
        if len(holders) < 2:
            continue
        sides = ", ".join(f"{value!r} on {describe_ranks(ranks)}" for value, ranks in
                          sorted(holders.items(), key=lambda item: min(item[1])))
        if name.startswith("TORUS_"):
            lines.append(f"{name} differs between ranks: {sides}")
        else:
            tables.append(f"{name} differs between ranks (TORUS_TUNING_FILE's table, or the cost model's inputs): "
                          f"{sides}")
    return lines or tables


def agree_settings(store, rank: int, size: int, mine: dict[str, str] | str) -> None:
    """Compares what the ranks of a group must share (`mine`: shared_values, or the error that
    keeps this rank from creating the group). Raises ConfigError, on every rank alike, naming
    each difference or the ranks that could not create the group; in a group of one, nothing."""
    if size == 1:
        return
    if isinstance(mine, str):
        store.set(_digest_key(rank), FAILED + mine)
    else:
        record = json.dumps(mine, sort_keys=True)
        store.set(_record_key(rank), record)
        store.set(_digest_key(rank), hashlib.sha256(record.encode()).hexdigest())
    if rank == 0:
        digests = [bytes(v).decode("utf-8", "replace") for v in store.multi_get([_digest_key(r) for r in range(size)])]
        verdict = _verdict(store, digests)
        store.set(_VERDICT_KEY, verdict)
    else:
        verdict = bytes(store.get(_VERDICT_KEY)).decode()
    if verdict:
        raise ConfigError(verdict)


def _verdict(store, digests: list[str]) -> str:
    """Rank 0's answer to every rank's digest: empty when they agree, else the error."""
    failed = failures_of(digests)
    if failed:
        return describe_failures(failed)
    by_digest: dict[str, list[int]] = {}
    for r, digest in enumerate(digests):
        by_digest.setdefault(digest, []).append(r)
    if len(by_digest) == 1:
        return ""
    groups = list(by_digest.values())
    texts = store.multi_get([_record_key(ranks[0]) for ranks in groups])
    records = {tuple(ranks): json.loads(bytes(text).decode()) for ranks, text in zip(groups, texts)}
    return "torus: the ranks of the group disagree on settings they must share: " + "; ".join(disagreements(records))
