"""Emulate a cluster on one machine: hosts as network namespaces, links shaped by tc tbf.

See emulate.py, or run `python -m benchmarks.cluster --help`.
"""

from .emulate import Cluster, ClusterError, cleanup, leftovers, main, parse_rate

__all__ = ["Cluster", "ClusterError", "cleanup", "leftovers", "main", "parse_rate"]
