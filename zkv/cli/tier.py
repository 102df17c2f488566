"""``zkv tier list`` / ``zkv tier clean``: the persistent CPU tiers
(``rank/tiers/tier_file.py``) a host holds.  A rank's tier outlives the rank (a
crash or a stop keeps it for the restart): one a restart would map again is
*kept for a restart*; one no restart can serve (an earlier layout's, once its
rank has a newer tier; an engine's whose journal does not check; one this
zkv cannot read) is an *orphan*.  ``clean`` removes orphans, and the kept
ones only when asked (``--with-kept``); a tier a live worker holds is never
touched (it holds a lock on it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import msgspec

from ..wire.vocab import Tier
from .options import env_option

_DIR = env_option(
    "--tier-dir",
    default="/dev/shm",
    envvar="ZKV_TIER_DIR",
    help="Where the workers keep their CPU tiers (zkv worker --tier-dir).",
)


@click.group()
def tier() -> None:
    """The CPU tiers that outlive their rank workers: list them, remove orphans."""


def _engine_of(journal: Path, tier: str) -> dict | None:
    """Whose KV a vLLM engine's tier holds, from the journal beside it (None: no journal)."""
    from ..rows.journal import Journal, JournalError

    try:
        found = Journal(journal, Tier(tier), 0).read()
    except JournalError as err:
        return {"error": f"its journal does not check ({err}): a restart serves none of it"}
    if found is None:
        return None
    ident = msgspec.to_builtins(found.header.identity)
    return {**ident, "cpu_gen": found.header.cpu_gen, "journaled": len(found.rows)}


def _said(engine: dict | None) -> str:
    if engine is None:
        return "no engine identity"
    if "error" in engine:
        return engine["error"]
    lay = engine["layout"]
    return (
        f"engine {engine['model']} (config {engine['config']}, weights {engine['weights']}, "
        f"block {lay.get('block_size')}, kv {lay.get('kv_dtype')}, tp {lay.get('tp')}): "
        f"{engine['journaled']} blocks journaled"
    )


@dataclass(frozen=True)
class Standing:
    """What a tier file is to a restart: ``kept`` (a restart would map it) and why, in words."""

    kept: bool
    why: str


def standing(info: Any, tiers: list[Any], engine: dict | None) -> Standing:
    """Whether a restart would adopt ``info`` (a ``TierInfo`` of ``tiers``, every tier of the
    directory; ``engine``: its vLLM journal as ``_engine_of`` reads it).  A rank restarts on
    one layout, so of its tiers it maps the one written last (the highest CPU generation,
    then the latest change); an engine adopts what its journal names only if the journal
    checks."""
    if info.owned:
        return Standing(True, f"held by pid {info.pid}")
    if info.bus == "?":
        return Standing(False, "orphan: not a tier file this zkv reads")
    if engine is not None and "error" in engine:
        return Standing(False, f"orphan: {engine['error']}")
    mine = [t for t in tiers if t.bus == info.bus and t.rank == info.rank]
    newest = max(mine, key=lambda t: (t.owned, t.gen, _changed(t.path)))
    if newest.path != info.path:
        return Standing(False, f"orphan: rank {info.rank} of this bus has a newer tier, {newest.path.name}")
    if engine is not None:
        return Standing(True, "kept for a warm restart of its engine")
    live = sorted({t.rank for t in tiers if t.bus == info.bus and t.owned})
    serving = f" (its bus runs here: rank {', '.join(map(str, live))} held)" if live else ""
    return Standing(True, f"kept for a restart of rank {info.rank}{serving}")


def _changed(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _standings(tier_dir: str) -> list[tuple[Any, dict | None, Standing]]:
    from ..rank.tiers.tier_file import journal_path, list_tiers

    tiers = list(list_tiers(tier_dir))
    engines = [_engine_of(journal_path(tier_dir, t.bus), Tier.CPU) for t in tiers]
    return [(t, engine, standing(t, tiers, engine)) for t, engine in zip(tiers, engines)]


@tier.command("list")
@_DIR
@click.option(
    "--disk-dir", default=None, help="Also the disk tier a vLLM engine keeps there (its disk_dir), and whose it is."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per tier.")
def list_cmd(tier_dir: str, disk_dir: str | None, as_json: bool) -> None:
    """Every tier file: its bus, rank, size, CPU generation, whether a live worker holds it,
    a restart would map it again (kept for a restart) or none can (orphan), and for a vLLM
    engine's tier whose KV it holds (model, config, weights, layout)."""
    from ..rows.journal import DISK_JOURNAL

    found = False
    for info, engine, stand in _standings(tier_dir):
        found = True
        if as_json:
            fields = {k: getattr(info, k) for k in ("bus", "rank", "rows", "row_bytes", "gen", "pid", "owned")}
            fields.update(bytes=info.nbytes, kept_for_restart=stand.kept and not info.owned, standing=stand.why)
            click.echo(json.dumps({"path": str(info.path), **fields, "engine": engine}))
            continue
        click.echo(
            f"{info.path}  bus {info.bus} rank {info.rank}: {info.rows} blocks of {info.row_bytes} bytes, "
            f"{info.nbytes / 2**20:.1f} MiB, CPU generation {info.gen}, {stand.why}; {_said(engine)}"
        )
    if not found and not as_json:
        click.echo(f"no CPU tiers in {tier_dir}")
    if disk_dir is not None:
        disks = sorted(Path(disk_dir).glob("zkv-rank*.disk"))
        engine = _engine_of(Path(disk_dir) / DISK_JOURNAL, Tier.DISK)
        for path in disks:
            size = path.stat().st_size
            if as_json:
                click.echo(json.dumps({"path": str(path), "bytes": size, "engine": engine}))
            else:
                click.echo(f"{path}  {size / 2**20:.1f} MiB on disk; {_said(engine)}")
        if not disks and not as_json:
            click.echo(f"no disk tiers in {disk_dir}")


@tier.command()
@_DIR
@click.option("--bus", default=None, help="Only this bus's tiers (the id in the file names: zkv tier list).")
@click.option("--all", "every_bus", is_flag=True, help="Every bus's orphans on this host (else name one with --bus).")
@click.option(
    "--with-kept",
    is_flag=True,
    help="Also the tiers kept for a restart (zkv tier list says which: a rank's latest tier, an engine's whose "
    "journal checks): their rank or engine then restarts with an empty CPU tier.",
)
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
def clean(tier_dir: str, bus: str | None, every_bus: bool, with_kept: bool, dry_run: bool) -> None:
    """Remove the orphaned tiers no restart would map again (and a vLLM engine's journal of them), and
    the rank locks killed workers left: of one bus (--bus), or of every bus on this host (--all).  A
    tier kept for a restart stays unless --with-kept; one a live worker holds always does."""
    from ..rank.tiers.rank_lock import clean_locks
    from ..rank.tiers.tier_file import clean_tiers

    if (bus is None) == (not every_bus):
        raise click.UsageError(
            "name the bus whose orphans to remove (--bus ID, as zkv tier list shows it) or pass --all for every "
            "bus on this host (--dry-run says what would go)"
        )
    stays = [] if with_kept else _standings(tier_dir)
    kept = [t.path for t, _, s in stays if s.kept and not t.owned and (bus is None or t.bus == bus)]
    removed = clean_tiers(tier_dir, bus, dry_run, keep=kept)
    verb = "would remove" if dry_run else "removed"
    for path in removed:
        click.echo(f"{verb} {path}")
    locks = clean_locks(tier_dir, bus, dry_run)
    click.echo(
        f"{sum(not p.name.endswith('.journal') for p in removed)} orphaned CPU tier(s) "
        f"{'would be removed' if dry_run else 'removed'} from {tier_dir}"
        + (f", {len(locks)} rank lock(s)" if locks else "")
        + (f"; {len(kept)} kept for a restart (--with-kept removes them too)" if kept else "")
        + (" (dry run: nothing removed)" if dry_run else "")
    )
