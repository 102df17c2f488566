"""zkv's own tiers below the engine's memory: the block-major CPU tier, the
file it lives in so that it outlives the process (and the rank's lock beside
it), and the disk tier with its I/O."""
