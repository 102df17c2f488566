"""The buses of a fleet: each a name, a broker address and the Curve keys a
client needs for it, given one by one or read from a fleet file (JSON, so
that Python 3.10 reads it without a TOML parser; docs/deploy.md, "A fleet
of buses").

A fleet file::

    {"zkv_fleet": 1,
     "curve_secret": "keys/trainer.key_secret", "curve_ranks": "keys/ranks",
     "buses": [{"name": "engine-0", "broker": "tcp://10.0.0.1:5555", "curve_server": "keys/broker-0.key"},
               {"name": "engine-1", "broker": "tcp://10.0.0.2:5555", "curve_server": "keys/broker-1.key"}]}

Top-level ``curve_*`` fields are the default of every bus; relative paths
are read from the file's directory.  Everything is checked when the file is
read, so a typo fails before any bus is paused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..net.curve import Curve
from ..net.endpoints import check_connect_address

FORMAT = 1
CURVE_FIELDS = ("curve_secret", "curve_server", "curve_ranks")
_BUS_FIELDS = {"name", "broker", *CURVE_FIELDS}
_TOP_FIELDS = {"zkv_fleet", "buses", *CURVE_FIELDS}
MAX_NAME = 128


@dataclass(frozen=True)
class BusSpec:
    """One bus of a fleet.  Without ``curve_secret`` the bus is spoken to in
    the clear (an ``ipc://`` or loopback bus); with it, ``curve_server`` (the
    broker's ``broker.key``) and ``curve_ranks`` (the rank public keys that may
    push results) are needed too, as for ``zkv pause --curve-secret``."""

    name: str
    broker: str
    curve_secret: str | None = None
    curve_server: str | None = None
    curve_ranks: str | None = None

    def curve(self) -> Curve | None:
        if self.curve_secret is None:
            return None
        return Curve(self.curve_secret, self.curve_server, self.curve_ranks)

    def check(self) -> "BusSpec":
        """This spec, or ValueError naming the bus and what is wrong."""
        if not isinstance(self.name, str) or not self.name or len(self.name) > MAX_NAME or not self.name.isprintable():
            raise ValueError(f"bus name {self.name!r}: a printable string of 1 to {MAX_NAME} characters")
        if not isinstance(self.broker, str):
            raise ValueError(f"bus {self.name}: broker {self.broker!r} is not an address string")
        try:
            check_connect_address(self.broker)
        except ValueError as err:
            raise ValueError(f"bus {self.name}: broker {err}") from None
        given = [f for f in CURVE_FIELDS if getattr(self, f) is not None]
        if given and self.curve_secret is None:
            raise ValueError(f"bus {self.name}: {', '.join(given)} without curve_secret")
        if self.curve_secret is not None:
            missing = [f for f in ("curve_server", "curve_ranks") if getattr(self, f) is None]
            if missing:
                raise ValueError(f"bus {self.name}: a Curve client needs {' and '.join(missing)} too")
        for f in given:
            path = Path(getattr(self, f))
            if not (path.is_dir() if f == "curve_ranks" else path.is_file()):
                raise ValueError(f"bus {self.name}: {f} {path} does not exist")
        return self


def fleet_of(
    buses: Iterable[BusSpec | str | Mapping[str, Any]], defaults: Mapping[str, Any] | None = None
) -> list[BusSpec]:
    """Checked specs with distinct names and addresses; a bare address is
    its own name, and ``defaults`` fill a bus's missing Curve fields."""
    out: list[BusSpec] = []
    for item in buses:
        if isinstance(item, str):
            spec = BusSpec(item, item)
        elif isinstance(item, BusSpec):
            spec = item
        else:
            spec = _from_map(item, len(out))
        for f in CURVE_FIELDS:
            if getattr(spec, f) is None and defaults and defaults.get(f) is not None:
                spec = replace(spec, **{f: defaults[f]})
        out.append(spec.check())
    if not out:
        raise ValueError("a fleet needs at least one bus")
    for what in ("name", "broker"):
        seen: set[str] = set()
        for spec in out:
            value = getattr(spec, what)
            if value in seen:
                raise ValueError(f"two buses of the fleet have the {what} {value!r}")
            seen.add(value)
    return out


def _from_map(item: Any, index: int) -> BusSpec:
    if not isinstance(item, Mapping):
        raise ValueError(f"bus {index}: {item!r} is not an address or a map")
    unknown = sorted(set(item) - _BUS_FIELDS)
    if unknown:
        raise ValueError(f"bus {index}: unknown fields {unknown} (known: {sorted(_BUS_FIELDS)})")
    if "broker" not in item:
        raise ValueError(f"bus {index}: no broker address")
    for f in CURVE_FIELDS:
        if item.get(f) is not None and not isinstance(item[f], str):
            raise ValueError(f"bus {index}: {f} must be a path string")
    broker = item["broker"]
    return BusSpec(
        item.get("name", broker), broker, item.get("curve_secret"), item.get("curve_server"), item.get("curve_ranks")
    )


def load_fleet_file(path: str | Path, defaults: Mapping[str, Any] | None = None) -> list[BusSpec]:
    """The buses of a fleet file; ValueError naming the file and the fault.
    ``defaults`` (the command line's Curve options) fill what the file leaves out."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"cannot read fleet file {path}: {err.strerror or err}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"fleet file {path} is not JSON: {err}") from None
    try:
        return _parse(doc, path.parent, defaults or {})
    except ValueError as err:
        raise ValueError(f"fleet file {path}: {err}") from None


def _parse(doc: Any, base: Path, outer: Mapping[str, Any]) -> list[BusSpec]:
    if not isinstance(doc, dict):
        raise ValueError("the top level must be an object with a 'buses' list")
    unknown = sorted(set(doc) - _TOP_FIELDS)
    if unknown:
        raise ValueError(f"unknown fields {unknown} (known: {sorted(_TOP_FIELDS)})")
    version = doc.get("zkv_fleet", FORMAT)
    if type(version) is not int or version != FORMAT:
        raise ValueError(f"zkv_fleet {version!r}: this zkv reads version {FORMAT}")
    buses = doc.get("buses")
    if not isinstance(buses, list):
        raise ValueError("'buses' must be a list of buses")
    defaults = {f: v for f, v in outer.items() if v is not None}
    defaults.update({f: _path(base, doc[f], f) for f in CURVE_FIELDS if doc.get(f) is not None})
    items = []
    for i, bus in enumerate(buses):
        if isinstance(bus, Mapping):
            bus = {**bus, **{f: _path(base, bus[f], f"bus {i}: {f}") for f in CURVE_FIELDS if bus.get(f) is not None}}
        items.append(bus)
    return fleet_of(items, defaults)


def _path(base: Path, value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a path string")
    return str(base / value) if not Path(value).is_absolute() else value
