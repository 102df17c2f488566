"""Radix tree over full token blocks, keyed by hash-chained block keys.

A node is a run of full blocks of ``block_size`` tokens along one path.  A
block's key hashes its parent block's key together with its own token ids, so
equal keys mean equal whole prefixes, a child lookup is one dict access (by
the child run's first key), and a run matches whole when its last key does;
blake2b over int32 little-endian bytes keeps keys identical across processes
and machines (unlike ``hash()``).  Partial trailing blocks are never keyed:
their KV is still being written.

The tree only keeps structure and per-run bookkeeping (state, blocks,
reference count, last access).  Policy lives in the manager; the LRU order of
eviction candidates lives in :class:`LeafQueue`.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import struct
from collections.abc import Callable, Iterator, Sequence
from hashlib import blake2b

from ..wire.vocab import Tier

KEY_BYTES = 16
ROOT_KEY = bytes(KEY_BYTES)


def check_block_size(block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")


def block_keys(tokens: Sequence[int], block_size: int, parent_key: bytes = ROOT_KEY) -> list[bytes]:
    """Chained keys of the full blocks of ``tokens`` (a trailing partial block is ignored)."""
    check_block_size(block_size)
    full_blocks = len(tokens) // block_size
    if full_blocks == 0:
        return []
    count = full_blocks * block_size
    try:
        data = memoryview(struct.pack(f"<{count}i", *tokens[:count]))
    except struct.error as exc:
        raise ValueError(f"token ids must be integers that fit in int32: {exc}") from exc
    stride = 4 * block_size
    keys: list[bytes] = []
    key = parent_key
    for start in range(0, full_blocks * stride, stride):
        digest = blake2b(key, digest_size=KEY_BYTES)
        digest.update(data[start : start + stride])
        key = digest.digest()
        keys.append(key)
    return keys


def keys_reusing(tokens: Sequence[int], block_size: int, blocks: int, known: Sequence[bytes]) -> list[bytes]:
    """Keys of the first ``blocks`` full blocks of ``tokens``, reusing ``known`` ones (a match's)."""
    reuse = list(known[:blocks])
    if len(reuse) == blocks:
        return reuse
    parent = reuse[-1] if reuse else ROOT_KEY
    return reuse + block_keys(tokens[len(reuse) * block_size : blocks * block_size], block_size, parent_key=parent)


class NodeState(enum.Enum):
    """Where a node's KV block lives.  The -ING states only exist while a task is awaited."""

    ON_GPU = "on_gpu"
    SWAPPING_OUT = "swapping_out"  # holds its GPU block and the CPU block being written
    ON_CPU = "on_cpu"
    SWAPPING_IN = "swapping_in"  # holds its CPU block and the GPU block being written
    SPILLING = "spilling"  # holds its CPU block and the disk block being written
    ON_DISK = "on_disk"
    LOADING = "loading"  # holds its disk block and the CPU block being written


# States that keep a parent on the GPU: a block on (or coming to) the GPU is only
# usable if its whole prefix is there too.
GPU_PINNING_STATES = frozenset({NodeState.ON_GPU, NodeState.SWAPPING_IN})
# States that let a parent go to the disk: every other one keeps it on the CPU or above.
DISK_STATES = frozenset({NodeState.ON_DISK, NodeState.SPILLING})


# Each state's pins as plain ints on the member (read per state change: an attribute, where a
# function call or an enum-keyed dict lookup costs several times more).
for _state in NodeState:
    _state.pins_gpu = int(_state in GPU_PINNING_STATES)  # type: ignore[attr-defined]
    _state.pins_cpu = int(_state not in DISK_STATES)  # type: ignore[attr-defined]


def pins_cpu(state: NodeState) -> bool:
    """``state not in DISK_STATES``: a child off the disk keeps its parent off the disk."""
    return bool(state.pins_cpu)  # type: ignore[attr-defined]


class RadixNode:
    """A run of cached full blocks along one path, resting on one tier together.

    One node per run, not per block: a request's blocks are made, touched,
    moved and dropped together, so the tree does that work once per run.  A
    run is cut (``RadixTree.split``) wherever its blocks would part: a match
    or an insert that ends inside it, an eviction or a move that takes only
    its deepest blocks.  ``keys`` are the run's block keys, in order;
    ``gpu_blocks`` / ``cpu_blocks`` / ``disk_blocks`` its block ids on each
    tier (None: none there; two during a move).  ``depth`` is the depth of its
    deepest block; ``ref_count`` counts the held stretches of leases that run
    through it (``BlockLease.held``).
    """

    __slots__ = (
        "keys",
        "parent",
        "children",
        "depth",
        "state",
        "gpu_blocks",
        "cpu_blocks",
        "disk_blocks",
        "ref_count",
        "last_access",
        "num_gpu_children",
        "num_cpu_children",
        "attached",
    )

    def __init__(
        self,
        keys: list[bytes],
        parent: RadixNode | None,
        state: NodeState,
        gpu_blocks: list[int] | None = None,
        cpu_blocks: list[int] | None = None,
    ) -> None:
        self.keys = keys
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}  # keyed by each child's first key
        self.depth: int = 0 if parent is None else parent.depth + len(keys)
        self.state = state
        self.gpu_blocks = gpu_blocks
        self.cpu_blocks = cpu_blocks
        self.disk_blocks: list[int] | None = None
        self.ref_count = 0
        self.last_access = 0
        self.num_gpu_children = 0  # children in GPU_PINNING_STATES
        self.num_cpu_children = 0  # children not in DISK_STATES
        self.attached = True

    def blocks_on(self, tier: Tier) -> list[int] | None:
        """This run's blocks on ``tier`` (None: it has none there)."""
        return self.gpu_blocks if tier == Tier.GPU else self.cpu_blocks if tier == Tier.CPU else self.disk_blocks

    def set_blocks(self, tier: Tier, blocks: list[int] | None) -> None:
        """Give this run ``blocks`` on ``tier``, one per key (None: take its blocks there away)."""
        if tier == Tier.GPU:
            self.gpu_blocks = blocks
        elif tier == Tier.CPU:
            self.cpu_blocks = blocks
        else:
            self.disk_blocks = blocks

    def __repr__(self) -> str:
        return (
            f"RadixNode(depth={self.depth - len(self.keys) + 1}..{self.depth}, "
            f"key={self.keys[0].hex()[:8] if self.keys else '-'}, {self.state.name}, "
            f"gpu={self.gpu_blocks}, cpu={self.cpu_blocks}, disk={self.disk_blocks}, refs={self.ref_count})"
        )


class RadixTree:
    """The block tree; the root is a keyless sentinel that counts as on-GPU."""

    def __init__(self, max_run: int | None = None) -> None:
        self.root = RadixNode([], None, NodeState.ON_GPU)
        self._num_nodes = 0
        self.max_run = max_run  # the most blocks a new node takes (None: any; 1: a node per block)

    def __len__(self) -> int:
        """How many nodes (runs) the tree holds."""
        return self._num_nodes

    def walk(self, keys: Sequence[bytes]) -> tuple[list[RadixNode], int]:
        """The nodes of the longest cached prefix of ``keys`` (root excluded) and its
        length in blocks; the last node may hold more blocks than the prefix reaches.

        Keys chain on their whole prefix, so two keys at one position are equal
        only if every key before them is: a run is matched whole when its last
        key is, and a partial match is found by bisection."""
        path: list[RadixNode] = []
        node = self.root
        matched = 0
        wanted = len(keys)
        while matched < wanted:
            child = node.children.get(keys[matched])
            if child is None:
                break
            run = child.keys
            end = matched + len(run)
            path.append(child)
            if end <= wanted and run[-1] == keys[end - 1]:
                matched = end
                node = child
                continue
            low, high = 1, min(len(run), wanted - matched)  # run[low - 1] matches; the answer is in low..high
            while low < high:
                middle = (low + high + 1) // 2
                if run[middle - 1] == keys[matched + middle - 1]:
                    low = middle
                else:
                    high = middle - 1
            matched += low
            break
        return path, matched

    def walk_split(self, keys: Sequence[bytes]) -> list[RadixNode]:
        """``walk``, with a last node that holds more than the prefix cut to it: every node
        returned lies wholly inside the prefix."""
        path, matched = self.walk(keys)
        if path:
            last = path[-1]
            beyond = last.depth - matched  # blocks of the last node past the prefix
            if beyond:
                path[-1] = self.split(last, len(last.keys) - beyond)
        return path

    def split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut ``node`` after its first ``at`` blocks and return the new node holding those
        (above it, in its place under the parent); ``node`` keeps the deeper rest, so its
        depth and its queue entries stay right.  Both halves keep the state, the last
        access and the references: a held stretch through one runs through the other."""
        if not 0 < at < len(node.keys):
            raise ValueError(f"cannot split a run of {len(node.keys)} blocks after {at}")
        parent = node.parent
        if parent is None:
            raise ValueError("the root has no blocks to split")
        head = RadixNode.__new__(RadixNode)
        keys = node.keys
        head.keys = keys[:at]
        del keys[:at]
        head.parent = parent
        head.children = {keys[0]: node}
        head.depth = node.depth - len(keys)
        state = head.state = node.state
        for name in ("gpu_blocks", "cpu_blocks", "disk_blocks"):
            blocks = getattr(node, name)
            if blocks is None:
                setattr(head, name, None)
            else:
                setattr(head, name, blocks[:at])
                del blocks[:at]
        head.ref_count = node.ref_count
        head.last_access = node.last_access
        head.num_gpu_children = state.pins_gpu  # type: ignore[attr-defined]
        head.num_cpu_children = state.pins_cpu  # type: ignore[attr-defined]
        head.attached = node.attached
        parent.children[head.keys[0]] = head
        node.parent = head
        self._num_nodes += 1
        return head

    def add_child(
        self,
        parent: RadixNode,
        keys: list[bytes],
        state: NodeState,
        gpu_blocks: list[int] | None = None,
        cpu_blocks: list[int] | None = None,
    ) -> RadixNode:
        """A new run of ``keys`` under ``parent`` (which must end where the run begins)."""
        if not keys:
            raise ValueError("a run holds one block or more")
        if keys[0] in parent.children:
            raise KeyError(f"key {keys[0].hex()} already cached under this parent")
        node = RadixNode(keys, parent, state, gpu_blocks, cpu_blocks)
        parent.children[keys[0]] = node
        parent.num_gpu_children += state.pins_gpu  # type: ignore[attr-defined]
        parent.num_cpu_children += state.pins_cpu  # type: ignore[attr-defined]
        self._num_nodes += 1
        return node

    def add_run(self, parent: RadixNode, keys: list[bytes], state: NodeState, gpu_blocks: list[int]) -> list[RadixNode]:
        """New GPU nodes for ``keys`` under ``parent``: one, or a chain of them of ``max_run``
        blocks at most; returns them, shallowest first."""
        step = self.max_run or len(keys)
        nodes: list[RadixNode] = []
        for start in range(0, len(keys), step):
            parent = self.add_child(parent, keys[start : start + step], state, gpu_blocks[start : start + step])
            nodes.append(parent)
        return nodes

    def remove_leaf(self, node: RadixNode) -> None:
        if node.children:
            raise ValueError("only leaves can be removed")
        parent = node.parent
        if parent is None or not node.attached:
            raise ValueError("node is the root or already removed")
        del parent.children[node.keys[0]]
        parent.num_gpu_children -= node.state.pins_gpu  # type: ignore[attr-defined]
        parent.num_cpu_children -= node.state.pins_cpu  # type: ignore[attr-defined]
        node.attached = False
        self._num_nodes -= 1

    def set_state(self, node: RadixNode, state: NodeState) -> None:
        """Change a node's state, keeping the parent's GPU- and CPU-children counts right."""
        parent = node.parent
        if parent is not None and node.attached:
            old = node.state
            parent.num_gpu_children += state.pins_gpu - old.pins_gpu  # type: ignore[attr-defined]
            parent.num_cpu_children += state.pins_cpu - old.pins_cpu  # type: ignore[attr-defined]
        node.state = state

    def iter_nodes(self) -> Iterator[RadixNode]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @staticmethod
    def subtree_children_first(node: RadixNode) -> list[RadixNode]:
        """``node`` and its descendants, every child listed before its parent."""
        order: list[RadixNode] = []
        stack = [node]
        while stack:
            current = stack.pop()
            order.append(current)
            stack.extend(current.children.values())
        order.reverse()
        return order


def first_depth(node: RadixNode) -> int:
    """The depth of the run's shallowest block."""
    return node.depth - len(node.keys) + 1


def depth_order(nodes: Sequence[RadixNode]) -> list[int] | None:
    """The blocks of ``nodes`` (each run's in order, run after run) sorted shallowest
    first, ties in the order given: as positions into that flat list, or None when
    it is already so (one run, or runs that do not interleave)."""
    if len(nodes) < 2:
        return None
    depths: list[int] = []
    ordered = True
    last = -1
    for node in nodes:
        first = first_depth(node)
        if first <= last:
            ordered = False
        depths.extend(range(first, node.depth + 1))
        last = node.depth
    if ordered:
        return None
    return sorted(range(len(depths)), key=depths.__getitem__)


class LeafQueue:
    """Eviction candidates, least recently used first and deeper first on ties.

    A lazy min-heap: entries are never updated in place.  An entry goes stale
    when its node is touched again or stops being a candidate; ``pop`` skips
    those.  So offer a node whenever it may have become a candidate; offering
    it twice is harmless.  O(log n) per offer and per pop.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, RadixNode]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def offer(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (node.last_access, -node.depth, next(self._order), node))

    def pop(self, is_candidate: Callable[[RadixNode], bool]) -> RadixNode | None:
        """The best node that is still a candidate, or None."""
        heap = self._heap
        while heap:
            last_access, _, _, node = heapq.heappop(heap)
            if node.last_access == last_access and is_candidate(node):
                return node
        return None

    def rebuild(self, nodes: Iterator[RadixNode], is_candidate: Callable[[RadixNode], bool]) -> None:
        """Drop stale entries (call when the heap grew much larger than the tree)."""
        self._heap = [(n.last_access, -n.depth, next(self._order), n) for n in nodes if is_candidate(n)]
        heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap.clear()
