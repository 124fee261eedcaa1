#!/usr/bin/env python3
"""ssh for the emulated cluster: `enter_host.py [ssh options] HOST WORDS...` runs the command, as
ssh would (its words joined by spaces, through `sh -c`), inside HOST's network namespace with
HOST's host name. The `mpiexec` launcher gives it to a real mpiexec as its remote shell (Hydra's
`-launcher-exec`, Open MPI's `plm_ssh_agent`), which starts the other hosts' ranks through it.

The hosts' namespaces come from TORUS_CLUSTER_NAMESPACES ("node0=torus-h0-123,node1=..."),
which the launcher sets."""

from __future__ import annotations

import os
import sys

NAMESPACES_VARIABLE = "TORUS_CLUSTER_NAMESPACES"
# ssh options that take a value: their value is not the host.
OPTIONS_WITH_VALUE = {"-b", "-c", "-E", "-F", "-i", "-J", "-l", "-m", "-o", "-p", "-Q", "-S", "-W"}


def namespaces() -> dict[str, str]:
    text = os.environ.get(NAMESPACES_VARIABLE, "")
    pairs = [item.split("=", 1) for item in text.split(",") if "=" in item]
    return {host: namespace for host, namespace in pairs}


def command_for(argv: list[str], known: dict[str, str]) -> list[str]:
    """The argv that runs the remote command of the ssh command line `argv` in its host."""
    words = list(argv)
    while words and words[0].startswith("-"):
        option = words.pop(0)
        if option in OPTIONS_WITH_VALUE and words:
            words.pop(0)
    if not words:
        raise SystemExit("enter_host: no host given")
    host = words.pop(0)
    if host not in known:
        raise SystemExit(f"enter_host: host {host!r} is not in the emulated cluster "
                         f"({NAMESPACES_VARIABLE}={os.environ.get(NAMESPACES_VARIABLE, '')!r})")
    return ["ip", "netns", "exec", known[host], "unshare", "--uts", "--", "sh", "-c",
            'hostname "$0" && exec sh -c "$1"', host, " ".join(words)]


def main() -> None:
    argv = command_for(sys.argv[1:], namespaces())
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
