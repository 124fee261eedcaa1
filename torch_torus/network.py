"""The address (IPv4, else IPv6) a rank listens on and publishes to its peers."""

from __future__ import annotations

import os
import socket
from typing import Mapping

import psutil

from .config import ConfigError


def interface_address(name: str) -> str:
    """The first IPv4 address of the network interface `name` (TORUS_SOCKET_IFNAME), else its
    first IPv6 address (a link-local one carries its scope, e.g. fe80::1%eth0)."""
    addresses = psutil.net_if_addrs().get(name, [])
    for family in (socket.AF_INET, socket.AF_INET6):
        found = [address.address for address in addresses if address.family == family]
        if found:
            return found[0]
    why = "has no IPv4 or IPv6 address" if addresses else "does not exist here"
    raise ConfigError(f"TORUS_SOCKET_IFNAME={name!r}: the interface {why}")


def local_address(ifname: str, environ: Mapping[str, str] | None = None) -> str:
    """The address this rank listens on and publishes to its peers: `ifname`'s when given;
    else the one that routes to MASTER_ADDR in `environ` (default os.environ); else the host
    name's; else loopback."""
    environ = os.environ if environ is None else environ
    if ifname:
        return interface_address(ifname)
    master = environ.get("MASTER_ADDR")
    if master:
        try:
            port = int(environ.get("MASTER_PORT", "29500") or 29500)
            for family, _, _, _, where in socket.getaddrinfo(master, port, type=socket.SOCK_DGRAM):
                with socket.socket(family, socket.SOCK_DGRAM) as probe:
                    probe.connect(where)
                    return probe.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
