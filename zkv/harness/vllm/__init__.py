"""A real vLLM engine with zkv as its offload backend: the rig, the floor of
any backend, ``zkv bench vllm`` and ``zkv up --demo --engine vllm``."""
