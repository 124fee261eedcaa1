"""The IPv4 address a rank listens on and publishes to its peers."""

from __future__ import annotations

import os
import socket
from typing import Mapping

import psutil

from .config import ConfigError


def interface_address(name: str) -> str:
    """The first IPv4 address of the network interface `name` (TORUS_SOCKET_IFNAME)."""
    addresses = psutil.net_if_addrs().get(name, [])
    ipv4 = [address.address for address in addresses if address.family == socket.AF_INET]
    if not ipv4:
        why = "has no IPv4 address" if addresses else "does not exist here"
        raise ConfigError(f"TORUS_SOCKET_IFNAME={name!r}: the interface {why}")
    return ipv4[0]


def local_address(ifname: str, environ: Mapping[str, str] | None = None) -> str:
    """The IPv4 address this rank listens on and publishes to its peers: `ifname`'s when given;
    else the one that routes to MASTER_ADDR in `environ` (default os.environ); else the host
    name's; else loopback."""
    environ = os.environ if environ is None else environ
    if ifname:
        return interface_address(ifname)
    master = environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, int(environ.get("MASTER_PORT", "29500") or 29500)))
                return probe.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
