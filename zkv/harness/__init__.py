"""zkv's tools, run as commands: a local broker + ranks as processes
(``cluster``, what ``zkv up`` starts), the demos, the chat workload, the
benchmarks (``zkv bench``) and the checks.  What only tests use lives in
``zkv.testing`` and ``tests/``."""

from .cluster import LocalCluster

__all__ = ["LocalCluster"]
