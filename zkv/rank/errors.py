"""The one error of the engine-cache layer: a stable ``code`` a rank can put
in a reply, and a reason that names the tensor, file or id at fault.

Codes: ``bad_layout`` (a tensor zkv cannot copy block by block, or a
descriptor that does not fit its buffers), ``bad_block_id``, ``released``
(the cache was detached), ``bad_manifest`` (unreadable, wrong version, bad
field), ``missing_file``, ``size_mismatch``, ``stale_manifest`` (another
generation than expected), ``no_device`` (a CUDA device named by UUID that
is not visible here), ``no_cache`` (a resume found no new engine cache to
attach), ``lost_block`` (a CPU tier block whose header or digest does not
check: a torn write or corruption; never served), ``tier_in_use`` (a
persistent CPU tier another live process has mapped); the disk tier's
``disk_lost`` (a block that failed its digest or holds nothing),
``disk_io``, ``disk_busy`` (its file held by another live process),
``disk_full`` and ``no_disk`` (the rank has no disk tier); the keyed store's
``store_down`` (it did not answer in time), ``store_miss`` (a name holds no
value: evicted, retired, never stored) and ``no_store`` (the rank has none)."""

from __future__ import annotations

from ..wire.errors import ZkvError

CODES = frozenset(
    {
        "bad_layout",
        "bad_block_id",
        "released",
        "bad_manifest",
        "missing_file",
        "size_mismatch",
        "stale_manifest",
        "no_device",
        "no_cache",
        "lost_block",
        "tier_in_use",
        "disk_lost",
        "disk_io",
        "disk_busy",
        "disk_full",
        "no_disk",
        "no_store",
        "store_down",
        "store_miss",
    }
)


class CacheError(ZkvError, ValueError):
    """A refused attach, descriptor, manifest or block id; ``code`` is one of CODES."""

    def __init__(self, code: str, reason: str):
        assert code in CODES, code
        super().__init__(code, reason)
