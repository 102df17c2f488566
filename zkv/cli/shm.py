"""``zkv shm list`` / ``zkv shm clean``: the shared-memory files engines'
``ShmArena`` made, and removing those whose owner is gone (a kill -9'd
engine's: ``zkv/rank/memory/shm_files.py`` says how an orphan is told apart)."""

from __future__ import annotations

import json
from typing import Any

import click

from ..rank.memory.shm_files import SHM_DIR, ShmFile, clean, list_files


def _state(f: ShmFile) -> str:
    if f.orphan:
        return "orphan"
    if f.held:
        return "held"
    if f.held is None:
        return "unreadable"
    if f.pid is None:
        return "no owner pid"
    return "owner running"  # free of locks, but its pid is a process: left alone


def _row(f: ShmFile) -> dict[str, Any]:
    return {"path": f.path, "bytes": f.nbytes, "pid": f.pid, "state": _state(f)}


def _table(files: list[ShmFile]) -> str:
    if not files:
        return "no zkv-* files"
    rows = [(str(f.pid if f.pid is not None else "-"), _state(f), str(f.nbytes), f.path) for f in files]
    widths = [max(len(r[i]) for r in [("pid", "state", "bytes", "path"), *rows]) for i in range(3)]
    lines = [("pid", "state", "bytes", "path"), *rows]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in lines)


directory_option = click.option(
    "--dir",
    "directory",
    default=SHM_DIR,
    show_default=True,
    type=click.Path(file_okay=False, exists=True),
    help="Where the engines' files are.",
)


@click.group()
def shm() -> None:
    """The shared-memory files of engines' KV caches (/dev/shm/zkv-*)."""


@shm.command("list")
@directory_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per file.")
def list_command(directory: str, as_json: bool) -> None:
    """Every zkv-* file: its owner pid, whether it is held, and whether it is an orphan."""
    files = list_files(directory)
    if as_json:
        for f in files:
            click.echo(json.dumps(_row(f)))
        return
    click.echo(_table(files))


@shm.command("clean")
@directory_option
@click.option("--dry-run", is_flag=True, help="Name the orphans, remove nothing.")
def clean_command(directory: str, dry_run: bool) -> None:
    """Remove the zkv-* files no process holds and whose owner pid is gone."""
    removed = clean(directory, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for f in removed:
        click.echo(f"{verb} {f.path} ({f.nbytes} bytes, owner pid {f.pid} gone)")
    click.echo(f"{verb} {len(removed)} orphaned files, {sum(f.nbytes for f in removed)} bytes")
