"""Model-based test of a rank's tiers (``BlockStore``, sans-IO): hypothesis
drives one store through fills, swaps, spills, loads, checksums, clears with
and without ``keep_cpu``, resumes to the same or another layout, moves of the
CPU generation and restarts of the rank process, beside a model of what every
CPU row and disk block holds.

The rule it pins (docs/protocol.md §6.2, §8.2): a read of a CPU row or disk
block that was not written in its current generation never ends ok (it
raises ``lost_block`` / ``disk_lost`` naming it), and a read of one that
was ends ok with exactly the bytes written.  Run with the CPU tier in process
memory and in a tier file that outlives the process.
"""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from zkv.rank.errors import CacheError
from zkv.rank.store import BlockStore, block_digests
from zkv.rank.tiers.disk_tier import DiskSpec
from zkv.rank.tiers.tier_file import TierPlace
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=1, gpu_blocks=6, cpu_blocks=6, block_size=4, kv_heads=2, head_dim=16)
OTHER = LAYOUT.with_changes(cpu_blocks=8)  # a resume to another layout: the CPU block count changes
DISK_BLOCKS = 6
Digest = bytes


def _ids(n: int, most: int = 3) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, n - 1), min_size=1, max_size=most, unique=True)


class TierModel(RuleBasedStateMachine):
    """One store and the model: ``cpu[row]`` / ``disk[block]`` is the digest of
    what was written there in the current generation, absent when it holds nothing."""

    FILE = False  # the CPU tier in a tier file (True) or in process memory

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="zkv-tier-model-")
        self.place = TierPlace("model", 0, f"{self.dir}/shm") if self.FILE else None
        self.layout = LAYOUT
        self.cpu_gen = 0
        self.store = self._open()
        self.cpu: dict[int, Digest] = {}
        self.disk: dict[int, Digest] = {}

    def _open(self) -> BlockStore:
        store = BlockStore.owned(self.layout, place=self.place, disk=DiskSpec(f"{self.dir}/disk", DISK_BLOCKS))
        store.set_cpu_gen(self.cpu_gen)  # what a rank learns from the next task header
        return store

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- writes --------------------------------------------------------------------

    @rule(ids=_ids(LAYOUT.gpu_blocks), seed=st.integers(0, 3))
    def fill_gpu(self, ids, seed):
        self.store.fill("gpu", ids, seed)

    @rule(data=st.data(), seed=st.integers(0, 3))
    def fill_cpu(self, data, seed):
        ids = data.draw(_ids(self.layout.cpu_blocks))
        self.store.fill("cpu", ids, seed)
        written = block_digests(self.store.tier.columns, ids)  # the bytes as written, read raw
        self.cpu.update(zip(ids, written))

    @rule(data=st.data())
    def swap_out(self, data):
        src = data.draw(_ids(self.layout.gpu_blocks))
        dst = data.draw(
            st.lists(st.integers(0, self.layout.cpu_blocks - 1), min_size=len(src), max_size=len(src), unique=True)
        )
        want = self.store.checksum("gpu", src)
        self.store.move("swap_out", src, dst)
        self.cpu.update(zip(dst, want))

    # --- reads (each also a write for swap_in, spill and load) ---------------------

    def _read(self, known: dict[int, Digest], ids: list[int], code: str, run):
        """``run()`` must raise ``code`` naming a row that holds nothing, else succeed."""
        empty = [i for i in ids if i not in known]
        try:
            result = run()
        except CacheError as err:
            assert err.code == code, err
            assert empty, f"{ids} all hold blocks of this generation, yet the read failed: {err}"
            assert any(str(i) in err.reason for i in empty), err
            return None
        assert not empty, f"rows {empty} hold nothing of this generation, yet the read ended ok"
        return result

    @rule(data=st.data())
    def checksum_cpu(self, data):
        ids = data.draw(st.lists(st.integers(0, self.layout.cpu_blocks - 1), min_size=1, max_size=3))
        got = self._read(self.cpu, ids, "lost_block", lambda: self.store.checksum("cpu", ids))
        if got is not None:
            assert got == [self.cpu[i] for i in ids], "a row came back with other bytes"

    @rule(data=st.data())
    def swap_in(self, data):
        src = data.draw(st.lists(st.integers(0, self.layout.cpu_blocks - 1), min_size=1, max_size=3))
        dst = data.draw(
            st.lists(st.integers(0, LAYOUT.gpu_blocks - 1), min_size=len(src), max_size=len(src), unique=True)
        )
        before = self.store.checksum("gpu", dst)
        if self._read(self.cpu, src, "lost_block", lambda: self.store.move("swap_in", src, dst)) is None:
            assert self.store.checksum("gpu", dst) == before, "a failed swap_in copied something"
        else:
            assert self.store.checksum("gpu", dst) == [self.cpu[i] for i in src]

    @rule(data=st.data())
    def spill(self, data):
        src = data.draw(st.lists(st.integers(0, self.layout.cpu_blocks - 1), min_size=1, max_size=3))
        dst = data.draw(st.lists(st.integers(0, DISK_BLOCKS - 1), min_size=len(src), max_size=len(src), unique=True))
        if self._read(self.cpu, src, "lost_block", lambda: self.store.move("spill", src, dst)) is not None:
            self.disk.update(zip(dst, [self.cpu[i] for i in src]))

    @rule(data=st.data())
    def load(self, data):
        src = data.draw(st.lists(st.integers(0, DISK_BLOCKS - 1), min_size=1, max_size=3))
        dst = data.draw(
            st.lists(st.integers(0, self.layout.cpu_blocks - 1), min_size=len(src), max_size=len(src), unique=True)
        )
        if self._read(self.disk, src, "disk_lost", lambda: self.store.move("load", src, dst)) is None:
            for i in dst:
                self.cpu.pop(i, None)  # a failed load's rows are lost, never served
        else:
            self.cpu.update(zip(dst, [self.disk[i] for i in src]))

    @rule(data=st.data())
    def checksum_disk(self, data):
        ids = data.draw(st.lists(st.integers(0, DISK_BLOCKS - 1), min_size=1, max_size=3))
        got = self._read(self.disk, ids, "disk_lost", lambda: self.store.checksum("disk", ids))
        if got is not None:
            assert got == [self.disk[i] for i in ids], "a disk block came back with other bytes"

    # --- the bus's cycle and the process's life ------------------------------------

    @rule(keep_cpu=st.booleans(), other=st.booleans())
    def clear_and_resume(self, keep_cpu, other):
        self.store.free(keep_cpu)
        if not keep_cpu:
            self.cpu, self.disk = {}, {}  # the bus's CPU generation moves with such a clear
            self.cpu_gen += 1
            self.store.set_cpu_gen(self.cpu_gen)
        layout = (OTHER if self.layout == LAYOUT else LAYOUT) if other else self.layout
        self.store.allocate(layout)
        if layout != self.layout:
            self.cpu, self.disk = {}, {}  # a new CPU block shape: neither tier is kept (cpu_kept false)
            self.layout = layout
        assert self.store.cpu_kept == (keep_cpu and not other)

    @rule()
    def move_cpu_gen(self):
        """The bus's CPU generation moved (a CPU tier lost on another rank): every row of the old one is gone."""
        self.cpu_gen += 1
        self.store.set_cpu_gen(self.cpu_gen)
        self.cpu, self.disk = {}, {}

    @rule()
    def restart(self):
        """The rank process stops and a new one starts: a tier file and the disk file are kept."""
        self.store.close()
        self.store = self._open()
        if not self.FILE:
            self.cpu = {}  # process memory is gone with the process

    @precondition(lambda self: self.FILE)
    @rule(data=st.data())
    def torn_write(self, data):
        """A kill in the middle of a write: the row's mark says "being written"."""
        row = data.draw(st.integers(0, self.layout.cpu_blocks - 1))
        self.store.tier.writing([row])
        self.cpu.pop(row, None)

    @invariant()
    def counts_only_rows_of_this_generation(self):
        if self.FILE:
            assert self.store.tier.valid_rows() >= 0
        else:
            assert self.store.tier.valid_rows() == len(self.cpu)


SETTINGS = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class TierFileModel(TierModel):
    FILE = True


TierModel.TestCase.settings = SETTINGS
TierFileModel.TestCase.settings = SETTINGS
test_tier_in_process_memory = TierModel.TestCase
test_tier_in_a_file = TierFileModel.TestCase
