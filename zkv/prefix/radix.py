"""Radix tree over full token blocks, keyed by hash-chained block keys.

One edge is one full block of ``block_size`` tokens.  A block's key hashes its
parent's key together with its own token ids, so equal keys mean equal whole
prefixes and a child lookup is one dict access; blake2b over int32
little-endian bytes keeps keys identical across processes and machines (unlike
``hash()``).  Partial trailing blocks are never keyed: their KV is still being
written.

The tree only keeps structure and per-node bookkeeping (state, blocks,
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
    """One cached full block; ``ref_count`` counts the leases that use it."""

    __slots__ = (
        "key",
        "parent",
        "children",
        "depth",
        "state",
        "gpu_block",
        "cpu_block",
        "disk_block",
        "ref_count",
        "last_access",
        "num_gpu_children",
        "num_cpu_children",
        "attached",
    )

    def __init__(
        self,
        key: bytes,
        parent: RadixNode | None,
        state: NodeState,
        gpu_block: int | None = None,
        cpu_block: int | None = None,
    ) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.state = state
        self.gpu_block = gpu_block
        self.cpu_block = cpu_block
        self.disk_block: int | None = None
        self.ref_count = 0
        self.last_access = 0
        self.num_gpu_children = 0  # children in GPU_PINNING_STATES
        self.num_cpu_children = 0  # children not in DISK_STATES
        self.attached = True

    def block_on(self, tier: Tier) -> int | None:
        """This node's block on ``tier`` (None: it has none there)."""
        return self.gpu_block if tier == Tier.GPU else self.cpu_block if tier == Tier.CPU else self.disk_block

    def set_block(self, tier: Tier, block: int | None) -> None:
        """Give this node block ``block`` on ``tier`` (None: take its block there away)."""
        if tier == Tier.GPU:
            self.gpu_block = block
        elif tier == Tier.CPU:
            self.cpu_block = block
        else:
            self.disk_block = block

    def __repr__(self) -> str:
        return (
            f"RadixNode(depth={self.depth}, key={self.key.hex()[:8]}, {self.state.name}, "
            f"gpu={self.gpu_block}, cpu={self.cpu_block}, disk={self.disk_block}, refs={self.ref_count})"
        )


class RadixTree:
    """The block tree; the root is a keyless sentinel that counts as on-GPU."""

    def __init__(self) -> None:
        self.root = RadixNode(ROOT_KEY, None, NodeState.ON_GPU)
        self._num_nodes = 0

    def __len__(self) -> int:
        return self._num_nodes

    def walk(self, keys: Sequence[bytes]) -> list[RadixNode]:
        """Nodes of the longest cached prefix of ``keys``, root excluded."""
        path: list[RadixNode] = []
        node = self.root
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def add_child(
        self,
        parent: RadixNode,
        key: bytes,
        state: NodeState,
        gpu_block: int | None = None,
        cpu_block: int | None = None,
    ) -> RadixNode:
        if key in parent.children:
            raise KeyError(f"key {key.hex()} already cached under this parent")
        node = RadixNode(key, parent, state, gpu_block, cpu_block)
        parent.children[key] = node
        parent.num_gpu_children += state.pins_gpu  # type: ignore[attr-defined]
        parent.num_cpu_children += state.pins_cpu  # type: ignore[attr-defined]
        self._num_nodes += 1
        return node

    def remove_leaf(self, node: RadixNode) -> None:
        if node.children:
            raise ValueError("only leaves can be removed")
        parent = node.parent
        if parent is None or not node.attached:
            raise ValueError("node is the root or already removed")
        del parent.children[node.key]
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
