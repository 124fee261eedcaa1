"""Emulate a cluster on one machine: hosts as network namespaces, links shaped by tc tbf.

See emulate.py (the command line; namespaces.py, links.py and launchers.py hold the network,
the links' shaping and the hosts' processes), or run `python -m benchmarks.cluster --help`.
"""

from .emulate import main
from .links import parse_rate
from .namespaces import Cluster, ClusterError, cleanup, leftovers

__all__ = ["Cluster", "ClusterError", "cleanup", "leftovers", "main", "parse_rate"]
