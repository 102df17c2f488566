"""A transformers engine on the real bus: the rig, ``zkv bench engine`` and
``zkv up --demo --engine transformers``."""
