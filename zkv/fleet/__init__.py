"""A fleet of buses, one per engine, driven as one: ``Fleet`` (``fleet.py``)
over ``spec`` (the buses and the fleet file), ``decision`` (all or nothing,
sans-IO), ``driver`` (one thread and client per bus, one deadline) and
``report`` (what the caller and the fleet record read)."""

from .decision import Answer, BusAnswer
from .fleet import Fleet
from .report import BusReport, FleetError, FleetReport
from .spec import BusSpec, load_fleet_file

__all__ = ["Answer", "BusAnswer", "BusReport", "BusSpec", "Fleet", "FleetError", "FleetReport", "load_fleet_file"]
