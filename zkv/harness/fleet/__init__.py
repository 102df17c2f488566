"""Several local buses at once: the rig of the fleet's tests and docs, and
``zkv bench fleet``."""
