"""``zkv state``: the broker's durable state file (``broker/state_file.py``)
as a person reads it, and the one-line description ``zkv up`` and
``zkv broker`` print of the bus they restore.

The file holds two fixed-size slots padded with spaces (so a torn write
never loses the older snapshot); ``json.load`` cannot read it whole, and
nothing here changes its form: it is read with the broker's own loader.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from .options import fail, json_option, state_file_option


def default_state_path() -> Path:
    """Where ``zkv up`` and a broker on the default ipc:// frontend keep it."""
    from ..broker.state_file import FILE_NAME
    from ..net.endpoints import runtime_dir

    return runtime_dir() / FILE_NAME


def load_state(path: str | Path) -> tuple[int, dict[str, Any]] | None:
    """``(seq, snapshot)`` of the newest whole snapshot, None when there is no
    file; ValueError (naming the file) when it holds none."""
    from ..broker.state_file import StateFile

    state_file = StateFile(path)
    snapshot = state_file.load()  # reads only: the file is opened for writing on the first save
    return None if snapshot is None else (state_file.seq, snapshot)


def describe_layout(layout: dict[str, Any] | None) -> str:
    if not layout:
        return "no layout yet (no rank ever registered)"
    return (
        f"{layout.get('layers')} layers x {layout.get('gpu_blocks')} GPU / {layout.get('cpu_blocks')} CPU blocks, "
        f"block {layout.get('block_size')} tokens, {layout.get('kv_heads')} kv heads x {layout.get('head_dim')}, "
        f"{layout.get('dtype')}"
    )


def describe(snapshot: dict[str, Any]) -> str:
    """One line: state, epoch, generation, world and layout."""
    return (
        f"{snapshot['state']} at epoch {snapshot['epoch']}, generation {snapshot['gen']}, "
        f"world {snapshot['world']}, layout {describe_layout(snapshot.get('layout'))}"
    )


def _text(path: Path, seq: int, snap: dict[str, Any]) -> str:
    lines = [
        f"{path} (snapshot {seq})",
        f"  state       {snap['state']}",
        f"  epoch       {snap['epoch']}  (a broker restarting from it starts at epoch {snap['epoch'] + 1})",
        f"  generation  {snap['gen']}" + ("  (tasks ran at it)" if snap.get("gen_used") else ""),
        f"  world       {snap['world']} ranks",
        f"  layout      {describe_layout(snap.get('layout'))}",
        f"  keep_cpu    {'yes' if snap.get('keep_cpu') else 'no'}",
    ]
    if snap.get("gen_reason"):
        lines.append(f"  generation {snap['gen']} because {snap['gen_reason']}")
    return "\n".join(lines)


@click.command()
@state_file_option(
    "The broker's state file (default: broker-state.json in the runtime directory, where zkv up keeps it)."
)
@json_option("Print it as JSON.")
def state(state_file: str | None, as_json: bool) -> None:
    """Print the broker's durable state: what a restarted broker (or zkv up) restores."""
    path = Path(state_file) if state_file else default_state_path()
    try:
        loaded = load_state(path)
    except ValueError as err:
        fail(str(err))
    except OSError as err:
        fail(f"cannot read {path}: {err.strerror or err}")
    if loaded is None:
        fail(
            f"no broker state at {path}",
            "a broker writes it as soon as it runs; pass --state-file for a broker with a tcp:// frontend",
        )
    seq, snap = loaded
    if as_json:
        click.echo(json.dumps({"file": str(path), "seq": seq, "snapshot": snap}))
    else:
        click.echo(_text(path, seq, snap))
    sys.exit(0)
