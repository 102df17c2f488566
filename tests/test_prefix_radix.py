"""Block keys, the radix tree's bookkeeping, and the LRU leaf queue."""

import os
import struct
import subprocess
import sys
from hashlib import blake2b

import pytest

from zkv.prefix.radix import ROOT_KEY, LeafQueue, NodeState, RadixTree, block_keys


def test_block_key_is_blake2b_over_parent_key_and_int32_le_tokens():
    tokens = [1, 2, 3, -4, 2**31 - 1, 0, 7, 8]
    first = blake2b(ROOT_KEY + struct.pack("<4i", 1, 2, 3, -4), digest_size=16).digest()
    second = blake2b(first + struct.pack("<4i", 2**31 - 1, 0, 7, 8), digest_size=16).digest()
    assert block_keys(tokens, 4) == [first, second]


def test_keys_chain_on_the_whole_prefix():
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    assert block_keys(a + b, 4)[0] == block_keys(a, 4)[0]
    assert block_keys(a + b, 4)[1] != block_keys(b, 4)[0]  # same tokens, different prefix
    assert block_keys(b + b, 4)[1] != block_keys(a + b, 4)[1]


def test_partial_block_is_ignored_and_bad_tokens_rejected():
    assert block_keys([1, 2, 3], 4) == []
    assert len(block_keys(list(range(11)), 4)) == 2
    with pytest.raises(ValueError, match="int32"):
        block_keys([2**31, 0, 0, 0], 4)
    with pytest.raises(ValueError):
        block_keys([1, 2], 0)


def test_keys_are_identical_in_another_process():
    code = "from zkv.prefix.radix import block_keys; print(block_keys(list(range(64)), 16)[-1].hex())"
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=os.pathsep.join(sys.path))
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert other.stdout.strip() == block_keys(list(range(64)), 16)[-1].hex()


def test_tree_walk_add_remove_and_gpu_child_count():
    tree = RadixTree()
    keys = block_keys(list(range(12)), 4)
    a = tree.add_child(tree.root, keys[0], NodeState.ON_GPU, gpu_block=0)
    b = tree.add_child(a, keys[1], NodeState.ON_GPU, gpu_block=1)
    assert tree.walk(keys) == [a, b] and len(tree) == 2
    assert (a.depth, b.depth, a.num_gpu_children) == (1, 2, 1)
    with pytest.raises(KeyError):
        tree.add_child(a, keys[1], NodeState.ON_CPU, cpu_block=0)
    tree.set_state(b, NodeState.SWAPPING_OUT)
    assert a.num_gpu_children == 0
    tree.set_state(b, NodeState.SWAPPING_IN)
    assert a.num_gpu_children == 1
    with pytest.raises(ValueError):
        tree.remove_leaf(a)
    tree.remove_leaf(b)
    assert a.num_gpu_children == 0 and not b.attached and tree.walk(keys) == [a]
    assert list(tree.iter_nodes()) == [a]
    assert RadixTree.subtree_children_first(a) == [a]


def test_leaf_queue_pops_lru_then_deeper_and_skips_stale_entries():
    tree = RadixTree()
    keys = block_keys(list(range(16)), 4)
    nodes = []
    parent = tree.root
    for i, key in enumerate(keys):
        parent = tree.add_child(parent, key, NodeState.ON_GPU, gpu_block=i)
        nodes.append(parent)
    old, mid, deep, deeper = nodes
    old.last_access, mid.last_access, deep.last_access, deeper.last_access = 1, 5, 5, 5
    queue = LeafQueue()
    for node in (mid, old, deep, deeper):
        queue.offer(node)
    always = lambda node: True  # noqa: E731
    assert queue.pop(always) is old
    assert queue.pop(always) is deeper  # tie on last access: deeper first
    deep.last_access = 9  # touched: its entry is stale now
    assert queue.pop(always) is mid
    assert queue.pop(always) is None
    queue.offer(deep)
    assert queue.pop(lambda node: node is not deep) is None
    queue.rebuild(tree.iter_nodes(), lambda node: node.depth >= 3)
    assert len(queue) == 2 and queue.pop(always) is deeper
