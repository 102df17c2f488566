"""The copies between an engine's regions and zkv's tiers: the copy engine
(``copier``), its CPU path (``cpu_copy``) and the staging buffers of its CUDA
path (``staging``)."""
