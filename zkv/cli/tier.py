"""``zkv tier list`` / ``zkv tier clean``: the persistent CPU tiers
(``rank/tiers/tier_file.py``) a host holds.  A rank's tier outlives the rank (a
crash keeps it for the restart); one whose rank never comes back is an
orphan, and ``clean`` removes those (a tier a live worker holds is never
touched: it holds a lock on it)."""

from __future__ import annotations

import json
from pathlib import Path

import click
import msgspec

from ..wire.vocab import Tier

_DIR = click.option(
    "--tier-dir",
    default="/dev/shm",
    show_default=True,
    envvar="ZKV_TIER_DIR",
    show_envvar=True,
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


@tier.command("list")
@_DIR
@click.option(
    "--disk-dir", default=None, help="Also the disk tier a vLLM engine keeps there (its disk_dir), and whose it is."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per tier.")
def list_cmd(tier_dir: str, disk_dir: str | None, as_json: bool) -> None:
    """Every tier file: its bus, rank, size, CPU generation, whether a live worker holds it,
    and for a vLLM engine's tier whose KV it holds (model, config, weights, layout)."""
    from ..rank.tiers.tier_file import journal_path, list_tiers
    from ..rows.journal import DISK_JOURNAL

    found = False
    for info in list_tiers(tier_dir):
        found = True
        engine = _engine_of(journal_path(tier_dir, info.bus), Tier.CPU)
        if as_json:
            fields = {k: getattr(info, k) for k in ("bus", "rank", "rows", "row_bytes", "gen", "pid", "owned")}
            click.echo(json.dumps({"path": str(info.path), **fields, "bytes": info.nbytes, "engine": engine}))
            continue
        owner = f"held by pid {info.pid}" if info.owned else "orphan (no live worker)"
        click.echo(
            f"{info.path}  bus {info.bus} rank {info.rank}: {info.rows} blocks of {info.row_bytes} bytes, "
            f"{info.nbytes / 2**20:.1f} MiB, CPU generation {info.gen}, {owner}; {_said(engine)}"
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
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
def clean(tier_dir: str, bus: str | None, every_bus: bool, dry_run: bool) -> None:
    """Remove the tiers no live worker holds (a restart of their rank then starts with an empty CPU tier;
    a vLLM engine's journal of them goes too), and the rank locks killed workers left: of one bus (--bus),
    or of every bus on this host (--all)."""
    from ..rank.tiers.rank_lock import clean_locks
    from ..rank.tiers.tier_file import clean_tiers

    if (bus is None) == (not every_bus):
        raise click.UsageError(
            "name the bus whose orphans to remove (--bus ID, as zkv tier list shows it) or pass --all for every "
            "bus on this host (--dry-run says what would go)"
        )
    removed = clean_tiers(tier_dir, bus, dry_run)
    verb = "would remove" if dry_run else "removed"
    for path in removed:
        click.echo(f"{verb} {path}")
    locks = clean_locks(tier_dir, bus, dry_run)
    click.echo(
        f"{sum(not p.name.endswith('.journal') for p in removed)} orphaned CPU tier(s) "
        f"{'would be removed' if dry_run else 'removed'} from {tier_dir}"
        + (f", {len(locks)} rank lock(s)" if locks else "")
        + (" (dry run: nothing removed)" if dry_run else "")
    )
