"""The settings every rank of a group must share, compared when the group is created.

A rank whose grid, transport, algorithm tables, chunk size or flow control differ from its peers'
would pair with the wrong peer or compute something else, silently or only at the timeout. So
when the ranks meet in the store (topology.agree), each tells rank 0 a digest of what it must
agree on: config.SETTINGS marked shared, and its tuning file's entries, which with the shared
settings and the group's hosts make its algorithm tables. Rank 0 compares the digests, and reads
the details of one rank per distinct digest only when they differ: the shared values, and the
tables each tuning file makes for this group, which rank 0 computes. A group whose ranks disagree
fails on every rank, naming each setting, each value and the ranks holding it.
"""

from __future__ import annotations

import hashlib
import json

from .config import SETTINGS, ConfigError, Rule, render_rules

def shared_values(values: dict) -> dict[str, str]:
    """Each shared setting's value (or the part of it that must agree) as text."""
    shared = {}
    for setting in SETTINGS:
        if setting.shared:
            value = values[setting.option]
            shared[setting.name] = str(setting.agreed(value)) if setting.agreed else setting.render(value)
    return shared


def table_texts(tables: dict[str, tuple[Rule, ...]]) -> dict[str, str]:
    """Each collective's resolved algorithm table as text, named as differences name it."""
    return {f"the {collective} table": render_rules(rules) for collective, rules in tables.items()}


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


def settings_record(values: dict, tuning: dict | None) -> tuple[str, str]:
    """(digest, detail) of what this rank must agree on with its peers: its shared settings and
    `tuning` ({"path", "entries": the tuning file's entries as stored}, or None)."""
    detail = json.dumps({"shared": shared_values(values), "tuning": tuning}, sort_keys=True)
    return hashlib.sha256(detail.encode()).hexdigest(), detail


def settings_verdict(digests: list[str], details, tables_of) -> str:
    """Rank 0's answer to every rank's digest (rank order): empty when the ranks agree, else the
    error. details(ranks) reads those ranks' settings_record details; tables_of(tuning) makes a
    rank's algorithm tables from its tuning (and rank 0's shared settings, equal to its own when
    they are compared), raising ConfigError when it cannot."""
    by_digest: dict[str, list[int]] = {}
    for r, digest in enumerate(digests):
        by_digest.setdefault(digest, []).append(r)
    if len(by_digest) == 1:
        return ""
    groups = list(by_digest.values())
    read = [json.loads(text) for text in details([ranks[0] for ranks in groups])]
    lines = disagreements({tuple(ranks): detail["shared"] for ranks, detail in zip(groups, read)})
    if not lines:
        tables, failed = {}, []
        for ranks, detail in zip(groups, read):
            try:
                tables[tuple(ranks)] = table_texts(tables_of(detail["tuning"]))
            except ConfigError as error:
                failed.append(f"{describe_ranks(ranks)} cannot create the group: {error}")
        if failed:
            return "; ".join(failed)
        lines = disagreements(tables)
    if not lines:
        return ""
    return "torus: the ranks of the group disagree on settings they must share: " + "; ".join(lines)
