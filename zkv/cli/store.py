"""``zkv store``: a keyed store below the ranks' CPU tiers, as an operator sees it
(docs/operations.md, "Keyed stores"): which namespaces (engine identities) it
holds and how much, and retiring one whose weights no engine serves any more."""

from __future__ import annotations

import json

import click

from .options import env_option


def _open(url: str):
    from ..rank.tiers.store_tier import open_store

    try:
        return open_store(url)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--store") from None


@click.group()
def store() -> None:
    """Look at or retire the namespaces of a keyed store (a host tier, a Redis tier)."""


@store.command("ls")
@env_option("--store", "url", required=True, envvar="ZKV_STORE", help="The store's URL.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: namespace -> {values, bytes}.")
def ls(url: str, as_json: bool) -> None:
    """Each namespace the store holds, its values and bytes."""
    from ..rank.errors import CacheError

    keyed = _open(url)
    try:
        held = keyed.namespaces()
    except CacheError as err:
        raise click.ClickException(f"{url}: {err.reason}") from None
    finally:
        keyed.close()
    if as_json:
        click.echo(json.dumps({ns: {"values": n, "bytes": b} for ns, (n, b) in held.items()}))
        return
    if not held:
        click.echo(f"{url}: no zkv values")
    for ns, (n, size) in held.items():
        click.echo(f"{ns}  {n} values  {size / 2**20:.1f} MiB")


@store.command("retire")
@env_option("--store", "url", required=True, envvar="ZKV_STORE", help="The store's URL.")
@click.argument("namespaces", nargs=-1, required=True)
def retire(url: str, namespaces: tuple[str, ...]) -> None:
    """Drop every value of each NAMESPACE (an engine identity no engine serves any more)."""
    from ..rank.errors import CacheError

    keyed = _open(url)
    try:
        for ns in namespaces:
            click.echo(f"{ns}: {keyed.retire(ns)} values retired")
    except CacheError as err:
        raise click.ClickException(f"{url}: {err.reason}") from None
    finally:
        keyed.close()
