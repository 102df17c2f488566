"""Running zkv for real on one machine: a local broker + ranks as processes
(``cluster``), the demo, the chat workload and the benchmarks."""

from .cluster import LocalCluster

__all__ = ["LocalCluster"]
