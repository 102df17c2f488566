"""zkv's tools, run as commands, one room per concept, each rig beside the
benchmarks and demos that drive it:

- ``bus``: a local broker + ranks as processes (``cluster``, what ``zkv up``
  starts; ``attached_cluster`` over a stand-in engine's memory), the life of
  a ``zkv up`` (``lifeline``), and the bus's benchmarks (``bench``: ``zkv
  bench``'s bus, copy and pause figures; codec, pause CPU, metrics, restart, disk);
- ``copies``: the copy path as the GPU check drives it, its benchmark and the check;
- ``prefix``: the chat workload through a prefix cache manager, its
  benchmark and ``zkv up --demo``;
- ``transformers`` and ``vllm``: a real engine on the bus, its benchmark and demo;
- ``fleet``: several buses at once, and the fleet pause's benchmark;
- ``vocab_count``: how many domain words are still spelled as strings.

What only tests use lives in ``zkv.testing`` and ``tests/``."""

from .bus.cluster import LocalCluster

__all__ = ["LocalCluster"]
