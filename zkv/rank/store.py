"""``BlockStore``: one rank's blocks, the one thing its executor copies.

A store is a device tier of regions (``EngineCache``) from a memory source
(``memory.OwnedMemory``: zkv's own tensors; ``memory.EngineMemory``: an
engine's, handed over in process or mapped from a manifest), zkv's
block-major CPU tier (``CpuTier``), the disk tier below it (``DiskTier``,
with ``--disk-dir``) and the paths between them (``CopyEngine`` between the
device and the CPU tier, the disk tier's I/O below).  What is the same for
every source lives here once: the ids a task may name, every tier move (one
rule for all, by the table of ``wire/moves.py``: ``move``), fill, checksum,
and the clear and resume rules.  The host tiers are objects that own their
rows, seals and generation; the store calls them as ``HostTier``.

Clear (``free``) drops every view of the device tier before it returns, so
before the rank acks: zkv's memory is then freed, an engine's is the
engine's to free.  zkv's CPU tier goes too unless ``keep_cpu``.  Resume
(``allocate``) takes the source's next cache, which must be a newer
generation (after a weight update the old KV is wrong, even at the same
address), and keeps the CPU tier only if the source says its rows still fit
(``MemorySource.tier_key``); ``cpu_kept`` says whether it did.  On a failure
the store holds no device tier and the error propagates (the rank stays
cleared and serving; a later resume tries again).

Tiers are named as on the wire: ``gpu`` is the device tier, ``cpu`` zkv's
swap space.  ``checksum`` of a block is the BLAKE2b of its page in every
region, in region order, which is exactly a CPU tier row: a block and the row
it was swapped to have one digest.  With a ``place`` the CPU tier is a tier
file that outlives the process (``cpu_tier.CpuTier``): ``restored`` says the
first allocation mapped one an earlier process of this rank left, and
``cpu_gen`` is the CPU generation its rows belong to.  With a ``keyed`` store
(``tiers/store_tier.py``: a host tier or a distributed one) the moves ``put``
and ``get`` name its side by keys (``move_keyed``).  One thread (the rank's
executor, or the I/O thread while nothing is queued) drives a store's copies;
the keyed moves run on the store lane (a CPU row is touched by one task at a
time: the client's book of rows sees to that)."""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch

from ..wire.errors import ReasonError
from ..wire.layout import CacheLayout
from ..wire.moves import MOVES
from ..wire.protocol import TaskBody
from ..wire.vocab import Op, Tier
from .copies.copier import CopyEngine
from .copies.staging import STAGING_BYTES
from .errors import CacheError
from .memory import geometry
from .memory.geometry import LayoutGiven
from .memory.handover import Attached
from .memory.regions import EngineCache, check_ids
from .sources import EngineMemory, MemorySource, OwnedMemory
from .tiers.cpu_tier import CpuTier, HostTier
from .tiers.disk_io import RowDigest, view_at
from .tiers.disk_link import DiskLink, ready_tiers
from .tiers.disk_tier import DiskLost, DiskSpec, DiskTier
from .tiers.store_tier import Frame, KeyedStore, digest_for, encode_value, layout_tag, name_of, read_head
from .tiers.tier_file import TierPlace

__all__ = ["BlockStore", "Freed", "TaskInvalid", "block_digests", "pick_device", "tensor_bytes"]


class TaskInvalid(ReasonError, ValueError):
    """A task that cannot run on this store (cleared caches); the message is the reason.
    Bad block ids are ``CacheError("bad_block_id")``."""


@dataclass(frozen=True)
class Freed:
    """What a clear did: bytes released (zkv's own, or engine memory it stopped
    viewing) and whether zkv's CPU tier survived it (``keep_cpu``)."""

    nbytes: int
    cpu_kept: bool


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (copied to host memory), without numpy,
    which torch does not depend on."""
    t = t.detach().to("cpu").contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def block_digests(tensors: Sequence[torch.Tensor], ids: Sequence[int]) -> list[bytes]:
    """A 16-byte BLAKE2b digest of every block (its slice of each tensor, in order), each hashed once."""
    known: dict[int, bytes] = {}
    for b in ids:
        if b not in known:
            h = hashlib.blake2b(digest_size=16)
            for t in tensors:
                h.update(tensor_bytes(t[b]))
            known[b] = h.digest()
    return [known[b] for b in ids]


def pick_device(rank: int) -> torch.device:
    """``cuda:R`` (modulo the visible GPUs) when CUDA exists, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


class BlockStore:
    """A rank's device tier, CPU tier and copy engine (see the module docstring).

    ``cache`` (the device tier's regions) and ``copier`` are None while cleared;
    ``tier`` too unless a clear kept it."""

    def __init__(
        self,
        memory: MemorySource,
        layout: CacheLayout,
        rank: int = 0,
        place: TierPlace | None = None,
        disk: DiskSpec | None = None,
    ):
        self.memory = memory
        self.place = place  # where a persistent CPU tier lives (None: process memory)
        # The CPU tier the first allocation mapped again from a previous process, and the CPU
        # generation its rows were of (``restored``, ``cpu_tier_found``).
        self._found: tuple[CpuTier, int] | None = None
        self.cpu_gen = 0  # the CPU generation new rows belong to (the bus's, once the rank hears it)
        self.disk_link = DiskLink(disk, rank) if disk is not None else None  # with --disk-dir
        self.rank = rank
        self.layout = layout  # what the rank announces; gpu_blocks / cpu_blocks bound the ids
        self.cache: EngineCache | None = None
        self.tier: CpuTier | None = None
        self.copier: CopyEngine | None = None
        self.cpu_kept = False  # whether the last allocate kept the CPU tier of a keep_cpu clear
        self.handover = Attached()  # the engine caches attached, and which one a resume may take
        self._tier_key: Hashable = None
        self.keyed: KeyedStore | None = None  # the keyed store below the CPU tier (the worker's --store)
        self._store_digest: RowDigest | None = None
        self.allocate(layout)

    @classmethod
    def owned(
        cls,
        layout: CacheLayout,
        device: torch.device | str = "cpu",
        rank: int = 0,
        staging_bytes: int = STAGING_BYTES,
        place: TierPlace | None = None,
        disk: DiskSpec | None = None,
    ) -> "BlockStore":
        """A store on memory zkv allocates on ``device`` for ``layout``."""
        return cls(OwnedMemory(device, staging_bytes), layout, rank, place, disk)

    @classmethod
    def attached(
        cls,
        cache: EngineCache,
        cpu_rows: int,
        *,
        layout: LayoutGiven = None,
        rank: int = 0,
        compute_stream: Any = None,
        pin: bool | None = None,
        source: Callable[[], EngineCache] | None = None,
        disk: DiskSpec | None = None,
        place: TierPlace | None = None,
    ) -> "BlockStore":
        """A store on an engine's cache.  ``layout``: None (announce the one derived
        from the cache), a ``CacheLayout`` or a map of fields, checked against the
        cache (``geometry.announced``: ``CacheError("bad_layout")`` naming both
        values when they disagree).  ``place``: a tier file, as for ``owned``."""
        announce = geometry.announced(cache.descriptor, cpu_rows, layout)
        memory = EngineMemory(cache, compute_stream=compute_stream, pin=pin, source=source)
        return cls(memory, announce, rank, place=place, disk=disk)

    @classmethod
    def from_manifest(cls, path: str, layout: LayoutGiven = None, rank: int = 0, **tiers: Any) -> "BlockStore":
        """A store on the tensors an engine process exported in ``path``
        (``manifest.export_manifest``); each resume reads it again, for a newer
        cache.  ``layout`` as for ``attached``; its ``cpu_blocks`` (default
        512) sizes the CPU tier; ``tiers``: ``disk`` and ``place`` of ``attached``.
        Raises ``CacheError`` if it cannot be mapped or does not fit ``layout``
        (nothing stays mapped)."""
        from .memory.manifest import attach

        if isinstance(layout, CacheLayout):
            cpu_rows = layout.cpu_blocks
        else:
            cpu_rows = (layout or {}).get("cpu_blocks", CacheLayout().cpu_blocks)
        cache = attach(path)
        try:
            return cls.attached(cache, cpu_rows, layout=layout, rank=rank, source=lambda: attach(path), **tiers)
        except BaseException:
            cache.release()
            raise

    # --- memory ------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.memory.device

    @property
    def allocated(self) -> bool:
        return self.cache is not None

    def allocate(self, layout: CacheLayout) -> int:
        """Attach the memory source's next device tier for ``layout`` (a resume,
        or the first allocation) and return the bytes held; on an error nothing
        of the device tier stays held and it propagates."""
        self._drop_device()  # a resume that changes the layout without a clear
        cache = self.memory.acquire(layout)
        try:
            self.handover.check(cache)
            geometry.check(layout, cache.descriptor, "the engine's new cache", resume=self.generation is not None)
            key = self.memory.tier_key(layout, cache.descriptor)
            kept = self.tier is not None and key == self._tier_key
            if not kept:
                self._drop_tier()  # drop the old rows before allocating new ones
                self.tier = CpuTier.for_cache(
                    cache.descriptor, layout.cpu_blocks, self.memory.pin, place=self.place, key=key, gen=self.cpu_gen
                )
                self._tier_key = key
                if self.generation is None and self.tier.kept:
                    self.cpu_gen = self.tier.gen or 0
                    self._found = (self.tier, self.cpu_gen)
            assert self.tier is not None
            if self.disk_link is not None:  # the disk's blocks: this layout's, at cpu_gen
                adopt = self.generation is None and not self.restored
                adopted = self.disk_link.sync(self.tier, layout, kept, self.cpu_gen, adopt)
                if adopted is not None:
                    self.set_cpu_gen(adopted)
            self.copier = CopyEngine(cache, self.tier, self.memory.compute_stream, self.memory.staging_bytes)
        except CacheError as err:
            # A cache of another layout is the engine's for a resume with its layout; anything
            # else wrong with it (stale, unreadable) is never taken: let it go.
            (self.memory.refused if err.code == "bad_layout" else self.memory.release)(cache)
            raise
        except BaseException:
            self.memory.release(cache)
            raise
        first = self.generation is None
        self.cache, self.layout, self.cpu_kept = cache, layout, kept
        self.handover.took(cache, first)
        return self.nbytes()

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier below the CPU tier (disk_tier.py): None without --disk-dir or before the first allocation."""
        return self.disk_link.disk if self.disk_link is not None else None

    @property
    def generation(self) -> int | None:
        """The generation of the device tier last attached (None before the first)."""
        return self.handover.generation

    @property
    def instance(self) -> str:
        return self.handover.instance

    def free(self, keep_cpu: bool = False) -> Freed:
        """Drop every view of the device tier (and the CPU tier unless kept); return bytes released."""
        freed = self.tier_nbytes()[Tier.GPU]
        self._drop_device()
        if not keep_cpu and self.tier is not None:
            freed += self.tier.nbytes
            self._drop_tier()
        if not keep_cpu and self.disk is not None:
            self.disk.invalidate()  # a clear that keeps the CPU tier keeps the disk tier too
        return Freed(freed, self.tier is not None)

    def _drop_tier(self, unlink: bool = True) -> None:
        """Drop the CPU tier; its file too (a clear), unless the rank only stops (``unlink=False``)."""
        tier, self.tier = self.tier, None
        if tier is not None:
            tier.close(unlink)

    def set_cpu_gen(self, gen: int) -> None:
        """The bus's CPU generation: new rows belong to it, and a mapped tier's
        rows of another one stop checking (they are gone for every client)."""
        self.cpu_gen = gen
        for tier in self.host_tiers().values():
            tier.set_cpu_gen(gen)  # the disk's blocks are CPU blocks moved down: gone with them

    def host_tiers(self) -> dict[Tier, HostTier]:
        """The tiers held in host memory or below it, as the store calls them (``cpu_tier.HostTier``)."""
        tiers: dict[Tier, HostTier] = {}
        if self.tier is not None:
            tiers[Tier.CPU] = self.tier
        if self.disk is not None:
            tiers[Tier.DISK] = self.disk
        return tiers

    def _drop_device(self) -> None:
        cache, copier = self.cache, self.copier
        self.cache = self.copier = None
        if copier is not None:
            copier.close()  # the device staging buffers
        if cache is not None:
            self.memory.release(cache)

    def close(self) -> None:
        """Drop everything (the rank stops): the device tier, the tier (a tier
        file stays for the next process of this rank: ``zkv tier clean``; the
        disk file stays valid for a restart), anything pending."""
        self._drop_device()
        self._drop_tier(unlink=False)
        if self.disk_link is not None:
            self.disk_link.close()
        if self.keyed is not None:
            self.keyed.close()
        self.memory.close()

    @property
    def restored(self) -> bool:
        """The first allocation mapped a CPU tier a previous process left."""
        return self._found is not None

    @property
    def cpu_tier_found(self) -> bool:
        """The CPU tier in use is the one this process found again, its rows still of the
        generation they were of (a clear without ``keep_cpu`` or a new tier ends that)."""
        found = self._found
        return found is not None and found[0] is self.tier and self.tier.gen == found[1]

    def kept_tiers(self, fresh: bool) -> dict[str, Any]:
        """A READY's kept tiers: content this process held in the bus or found again, at ``cpu_gen``."""
        cpu = self.tier is not None and (not fresh or self.restored)
        return ready_tiers(cpu, self.disk, self.cpu_gen, fresh)

    def tier_nbytes(self) -> dict[str, int]:
        return {
            Tier.GPU: sum(b.nbytes for b in self.cache.descriptor.buffers) if self.cache is not None else 0,
            Tier.CPU: self.tier.nbytes if self.tier is not None else 0,
            **({Tier.DISK: self.disk.nbytes} if self.disk is not None else {}),
        }

    def nbytes(self, held: dict[str, int] | None = None) -> int:
        """Memory held (the device and CPU tiers; the disk file is not memory);
        ``held``: ``tier_nbytes()`` when the caller has it already."""
        n = self.tier_nbytes() if held is None else held
        return n[Tier.GPU] + n[Tier.CPU]

    # --- tasks ---------------------------------------------------------------------

    def validate(self, body: TaskBody) -> None:
        """The one rule for which ids a task may name: ``TaskInvalid`` while
        cleared, ``CacheError("bad_block_id")`` for an id out of range, twice
        in a destination, or reserved by the engine in a move or a device-tier
        fill (a checksum may read a reserved block).  A move's tiers are the
        table's (``wire/moves.py``)."""
        if self.cache is None:
            raise TaskInvalid("caches are cleared on this rank")
        self.handover.used = True
        op = body.op
        move = MOVES.get(op)
        if move is not None and move.keyed:
            if self.keyed is None:
                raise CacheError("no_store", f"rank {self.rank} has no keyed store (start it with --store)")
            self._check_ids(move.rows, getattr(body, move.rows), Tier.CPU, unique=move.rows == "dst")
        elif move is not None:
            self._check_ids("src", body.src, move.source, unique=False)
            self._check_ids("dst", body.dst, move.dest, unique=True)
        elif op == Op.FILL:
            if body.tier == Tier.DISK:
                raise TaskInvalid("fill is not offered on the disk tier: fill cpu blocks, then spill them")
            self._check_ids("dst", body.dst, Tier(body.tier), unique=True)
        elif op == Op.CHECKSUM:
            self._check_ids("src", body.src, Tier(body.tier), unique=False, reserved=False)

    def _check_ids(self, what: str, ids: Sequence[int], tier: Tier, unique: bool, reserved: bool = True) -> None:
        """``check_ids`` against ``tier``'s block count; the engine's own device
        rows are never moved or filled (``reserved``), only read by a checksum."""
        assert self.cache is not None
        held = self.cache.descriptor.reserved_ids if reserved and tier == Tier.GPU else frozenset()
        check_ids(what, ids, tier, self._blocks(tier), unique, held)

    def _blocks(self, tier: Tier) -> int:
        """How many blocks ``tier`` holds (the layout's counts: ``allocate`` sized the tiers by them)."""
        if tier == Tier.GPU:
            return self.layout.gpu_blocks
        if tier == Tier.CPU:
            return self.layout.cpu_blocks
        if self.disk is None:
            raise CacheError("no_disk", f"rank {self.rank} has no disk tier (start it with --disk-dir)")
        return self.disk.rows

    def move(self, op: Op | str, src: Sequence[int], dst: Sequence[int]) -> int:
        """Move blocks ``src[i]`` to ``dst[i]`` between the tiers of ``op``
        (``wire/moves.py``; ids validated) and return the bytes moved once they
        are there.  The rules are the same for every move: CPU rows read are
        checked first (a lost block fails the task, never copies other bytes;
        a disk block's digest is checked as it is read), CPU rows written are
        unsealed before and sealed after (a failure or a kill in between leaves
        them lost, never other bytes)."""
        assert self.copier is not None and self.tier is not None, "a move on a cleared store"
        move = MOVES[op]
        if move.source == Tier.CPU:
            self.tier.check_rows(src)
        if move.dest == Tier.CPU:
            self.tier.writing(dst)
        nbytes = self._transfer(move.op, src, dst)
        if move.dest == Tier.CPU:
            self.tier.written(dst)
        return nbytes

    def move_group(self, op: Op | str, tasks: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[int | CacheError]:
        """The disk moves of several tasks, all ``spill`` or all ``load`` (ids validated, no
        destination twice among them), in one pass: one write and one ``fdatasync`` for
        the spills, one read for the loads, so rows back to back on both sides are one I/O
        whichever task they came from.  Each task keeps its own outcome, the bytes it moved
        or the error that failed it: alone (a lost CPU row, a disk block lost) or with the
        others (the device's error).  ``move``'s rules hold for each task."""
        assert self.tier is not None, "a move on a cleared store"
        cpu, disk = self.tier, self._disk()
        out: list[int | CacheError] = [0] * len(tasks)
        go: list[int] = []
        if op == Op.SPILL:
            for i, (src, _) in enumerate(tasks):
                try:
                    cpu.check_rows(src)
                    go.append(i)
                except CacheError as err:
                    out[i] = err
        else:
            cpu.writing([d for _, dst in tasks for d in dst])
            empty = set(disk.empty([s for src, _ in tasks for s in src]))
            for i, (src, _) in enumerate(tasks):
                lost = sorted(empty.intersection(src))
                if lost:
                    out[i] = DiskLost.empty(lost)  # its rows stay unsealed: lost, as after a failed load
                else:
                    go.append(i)
        if not go:
            return out
        src = [s for i in go for s in tasks[i][0]]
        dst = [d for i in go for d in tasks[i][1]]
        try:
            if op == Op.SPILL:
                disk.write(dst, cpu.addresses(src), cpu.stride)
                bad: set[int] = set()
            else:
                bad = set(disk.read_rows(src, cpu.addresses(dst), cpu.stride))
        except CacheError as err:
            for i in go:
                out[i] = err
            return out
        for i in go:
            src_i, dst_i = tasks[i]
            lost = sorted(bad.intersection(src_i))
            if lost:
                out[i] = DiskLost.torn(lost)
                continue
            if op == Op.LOAD:
                cpu.written(dst_i)
            out[i] = len(src_i) * disk.row_bytes
        return out

    def _transfer(self, op: Op, src: Sequence[int], dst: Sequence[int]) -> int:
        """The transfer path of each move: the copy engine between the device and
        the CPU tier, the disk tier's I/O between the CPU tier and its file (chosen
        by ``if``: a table built here would be built again for every task)."""
        assert self.copier is not None and self.tier is not None
        if op is Op.SWAP_OUT:
            return self.copier.copy_out(src, dst)
        if op is Op.SWAP_IN:
            return self.copier.copy_in(src, dst)
        cpu = self.tier
        if op is Op.SPILL:
            return self._disk().write(dst, cpu.addresses(src), cpu.stride)
        return self._disk().read(src, cpu.addresses(dst), cpu.stride)

    def move_keyed(self, op: Op | str, body: TaskBody) -> int:
        """A ``put`` (CPU rows to the keyed store) or a ``get`` (the store to CPU rows), under
        ``move``'s rules: CPU rows read are checked first; rows written are unsealed before
        and sealed after, and only when every value came back whole, named as asked (its
        namespace, rank, key, layout) and checking against its digest (``store_tier``); a
        value absent (``store_miss``), foreign or torn (``lost_block``), or a store that does
        not answer (``store_down``) fails the task and leaves its rows lost, never served."""
        assert self.tier is not None and self.keyed is not None and body.keys is not None
        cpu, keyed, move = self.tier, self.keyed, MOVES[op]
        names = [name_of(body.ns, self.rank, key) for key in body.keys]
        n, tag, digest = cpu.row_bytes, layout_tag(cpu.page_shape), self._digest(cpu.row_bytes)
        if move.rows == "src":  # a put
            cpu.check_rows(body.src)
            addresses = cpu.addresses(body.src)
            frames = [Frame(body.ns, self.rank, key, tag, n, d) for key, d in zip(body.keys, digest.of(addresses))]
            keyed.put(names, [encode_value(f, view_at(a, n)) for f, a in zip(frames, addresses)])
            return n * len(names)
        cpu.writing(body.dst)
        addresses = cpu.addresses(body.dst)
        heads = keyed.get_into(names, [view_at(a, n) for a in addresses])
        missing = [key.hex()[:16] for key, head in zip(body.keys, heads) if head is None]
        if missing:
            shown = ", ".join(missing[:4])
            raise CacheError("store_miss", f"{len(missing)} of {len(names)} keys hold no value ({shown})")
        stored = [read_head(h, Frame(body.ns, self.rank, k, tag, n, b"")) for k, h in zip(body.keys, heads)]  # type: ignore[arg-type]
        bad = [k.hex()[:16] for k, s, d in zip(body.keys, stored, digest.of(addresses)) if s != d]
        if bad:
            raise CacheError(
                "lost_block", f"store values of keys {', '.join(bad[:4])}: their rows do not check (digest)"
            )
        cpu.written(body.dst)
        return n * len(names)

    def _digest(self, row_bytes: int) -> RowDigest:
        if self._store_digest is None or self._store_digest.words * 8 + self._store_digest.tail != row_bytes:
            self._store_digest = digest_for(row_bytes)
        return self._store_digest

    def _disk(self) -> DiskTier:
        assert self.disk is not None, "a disk move on a rank without a disk tier"
        return self.disk

    def views(self, tier: str) -> list[torch.Tensor]:
        """A tier as ``[blocks, page_bytes]`` uint8 views, one per region, in region order."""
        if tier == Tier.GPU:
            assert self.cache is not None, "the device tier is cleared"
            return self.cache.views
        assert self.tier is not None, "the CPU tier is cleared"
        return self.tier.columns

    def fill(self, tier: str, ids: Sequence[int], seed: int) -> int:
        """Write deterministic random bytes (per seed, rank and id order) into blocks."""
        rng = torch.Generator().manual_seed((seed * 1_000_003 + self.rank) % 2**64)  # any uint seed (up to 2^53-1)
        index = torch.tensor(list(ids), dtype=torch.long)
        views = self.views(tier)
        if tier == Tier.CPU:
            assert self.tier is not None
            self.tier.writing(ids)
        for view in views:
            values = torch.randint(0, 256, (len(ids), view.shape[1]), dtype=torch.uint8, generator=rng)
            view.index_copy_(0, index.to(view.device), values.to(view.device))
        if views and views[0].is_cuda:
            torch.cuda.synchronize(views[0].device)
        if tier == Tier.CPU:
            assert self.tier is not None
            self.tier.written(ids)
        return len(ids) * sum(v.shape[1] for v in views)

    def checksum(self, tier: str, ids: Sequence[int]) -> list[bytes]:
        """A 16-byte BLAKE2b digest of every block (its page in every region; a disk block
        is read back and its stored digest checked first); a lost CPU block fails it
        (``CacheError("lost_block")``)."""
        host = self.host_tiers().get(Tier(tier))
        if host is not None:
            return host.checksum(ids)
        return block_digests(self.views(tier), ids)
