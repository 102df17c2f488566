"""A Curve-secured zkv bus laid out on a network-namespace ``Lab``: which host runs the
broker and which the ranks, their ports, their keys, and the only place that knows the
CLI's Curve flags, so a multi-host test starts what a user would run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ...wire.vocab import Dtype
from .netns import ClientAgent, Host, Lab, Proc

PORTS = {"frontend": 5555, "backend": 5556, "control": 5557}


@dataclass
class Bus:
    """A Curve-secured zkv bus on a Lab: a broker host, rank hosts, client hosts."""

    lab: Lab
    world: int = 2
    layout: Sequence[str] = (
        "--layers",
        "2",
        "--gpu-blocks",
        "32",
        "--cpu-blocks",
        "32",
        "--block-size",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--dtype",
        Dtype.FP32,
    )
    broker_args: Sequence[str] = ()
    worker_args: Sequence[str] = ()
    broker: Proc | None = None
    workers: dict[int, Proc] = field(default_factory=dict)
    keys: Path = Path()  # set by make_keys: every NAME.key / NAME.key_secret
    ranks_dir: Path = Path()  # set by make_keys: the ranks' public keys (broker backend, clients' result PULL)
    clients_dir: Path = Path()  # set by make_keys: the clients' public keys (broker frontend)

    @property
    def broker_host(self) -> Host:
        return self.lab.hosts["broker"]

    def address(self, which: str) -> str:
        return self.broker_host.tcp(PORTS[which])

    def make_keys(self) -> None:
        """``zkv keygen`` for every party; the ranks' and the clients' public
        keys go in separate directories, since each role is authorized apart
        (the broker's secret stays with it)."""
        self.keys = self.lab.dir / "keys"
        self.ranks_dir = self.lab.dir / "ranks"
        self.clients_dir = self.lab.dir / "clients"
        ranks = [f"rank{r}" for r in range(self.world)]
        subprocess.run(
            [sys.executable, "-m", "zkv", "keygen", str(self.keys), "broker", *ranks, "client"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        for directory, names in ((self.ranks_dir, ranks), (self.clients_dir, ["client"])):
            directory.mkdir(exist_ok=True)
            for name in names:
                shutil.copy(self.keys / f"{name}.key", directory)

    # The only place that knows the Curve command-line flags.
    def broker_curve_args(self) -> list[str]:
        return [
            "--curve-secret",
            str(self.keys / "broker.key_secret"),
            "--curve-ranks",
            str(self.ranks_dir),
            "--curve-clients",
            str(self.clients_dir),
        ]

    def worker_curve_args(self, rank: int) -> list[str]:
        return [
            "--curve-secret",
            str(self.keys / f"rank{rank}.key_secret"),
            "--curve-server",
            str(self.keys / "broker.key"),
        ]

    def client_curve(self) -> dict:
        return {
            "secret_file": str(self.keys / "client.key_secret"),
            "server_public_file": str(self.keys / "broker.key"),
            "ranks_dir": str(self.ranks_dir),
        }

    def start_broker(self) -> Proc:
        self.broker = self.lab.spawn(
            "broker",
            "broker",
            [
                sys.executable,
                "-m",
                "zkv",
                "broker",
                "--frontend",
                self.address("frontend"),
                "--backend",
                self.address("backend"),
                "--control",
                self.address("control"),
                "--world-size",
                str(self.world),
                *self.broker_curve_args(),
                *self.broker_args,
            ],
        )
        return self.broker

    def start_worker(self, rank: int) -> Proc:
        self.workers[rank] = self.lab.spawn(
            f"rank{rank}",
            f"rank{rank}",
            [
                sys.executable,
                "-m",
                "zkv",
                "worker",
                "--rank",
                str(rank),
                "--world-size",
                str(self.world),
                "--backend",
                self.address("backend"),
                "--control",
                self.address("control"),
                "--device",
                "cpu",
                *self.layout,
                *self.worker_curve_args(rank),
                *self.worker_args,
            ],
        )
        return self.workers[rank]

    def start(self) -> "Bus":
        self.make_keys()
        # Ranks first: over TCP they must cope with a broker that is not there yet.
        for rank in range(self.world):
            self.start_worker(rank)
        self.start_broker()
        return self

    def client(self, role: str = "client", name: str = "client", **config: Any) -> ClientAgent:
        cfg = {"broker": self.address("frontend"), "curve": self.client_curve(), **config}
        return ClientAgent(self.lab, role, name, cfg)
