"""The synthetic chat workload through a prefix cache manager over the real
bus: ``zkv up --demo`` and the manager's benchmarks."""
