"""Block keys, the radix tree of runs (walks, cuts, bookkeeping), and the LRU leaf queue."""

import os
import struct
import subprocess
import sys
from hashlib import blake2b

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zkv.prefix.radix import ROOT_KEY, LeafQueue, NodeState, RadixTree, block_keys, depth_order, first_depth


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
    keys = block_keys(list(range(20)), 4)
    a = tree.add_child(tree.root, keys[:2], NodeState.ON_GPU, gpu_blocks=[0, 1])
    b = tree.add_child(a, keys[2:4], NodeState.ON_GPU, gpu_blocks=[2, 3])
    assert tree.walk(keys) == ([a, b], 4) and len(tree) == 2
    assert (a.depth, b.depth, a.num_gpu_children, first_depth(b)) == (2, 4, 1, 3)
    with pytest.raises(KeyError):
        tree.add_child(a, keys[2:3], NodeState.ON_CPU, cpu_blocks=[0])
    tree.set_state(b, NodeState.SWAPPING_OUT)
    assert a.num_gpu_children == 0
    tree.set_state(b, NodeState.SWAPPING_IN)
    assert a.num_gpu_children == 1
    with pytest.raises(ValueError):
        tree.remove_leaf(a)
    tree.remove_leaf(b)
    assert a.num_gpu_children == 0 and not b.attached and tree.walk(keys) == ([a], 2)
    assert list(tree.iter_nodes()) == [a]
    assert RadixTree.subtree_children_first(a) == [a]


def test_a_walk_that_ends_inside_a_run_finds_where_and_walk_split_cuts_it_there():
    tree = RadixTree()
    keys = block_keys(list(range(24)), 4)
    run = tree.add_child(tree.root, keys[:5], NodeState.ON_GPU, gpu_blocks=[10, 11, 12, 13, 14])
    run.ref_count, run.last_access = 2, 7
    other = block_keys(list(range(12)) + [99] * 12, 4)  # shares the first three blocks
    assert tree.walk(other) == ([run], 3) and tree.walk(keys[:2]) == ([run], 2)
    assert tree.walk(block_keys([5] * 8, 4)) == ([], 0)
    (head,) = tree.walk_split(other)
    assert head is not run and head.keys == keys[:3] and head.gpu_blocks == [10, 11, 12]
    assert run.keys == keys[3:5] and run.gpu_blocks == [13, 14] and run.parent is head
    assert (head.depth, run.depth, len(tree)) == (3, 5, 2)
    assert (head.state, head.ref_count, head.last_access) == (NodeState.ON_GPU, 2, 7)
    assert head.num_gpu_children == 1 and tree.root.num_gpu_children == 1
    assert tree.walk(keys) == ([head, run], 5)
    with pytest.raises(ValueError):
        tree.split(run, 2)


@settings(max_examples=60 if os.environ.get("ZKV_LONG_MODEL") else 25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=8), min_size=1, max_size=8), st.data())
def test_a_tree_of_runs_matches_as_a_set_of_cached_prefixes(prompts, data):
    """Runs made and cut by walk_split answer every walk as the per-block prefixes they hold."""
    tree = RadixTree()
    cached: set[bytes] = set()
    next_block = 0
    for prompt in prompts:
        keys = block_keys(prompt, 1)
        path = tree.walk_split(keys)
        matched = sum(len(node.keys) for node in path)
        if matched < len(keys):
            parent = path[-1] if path else tree.root
            fresh = keys[matched:]
            tree.add_child(parent, list(fresh), NodeState.ON_GPU, list(range(next_block, next_block + len(fresh))))
            next_block += len(fresh)
        cached.update(keys)
    for node in tree.iter_nodes():
        assert node.keys and len(node.gpu_blocks) == len(node.keys)
        assert node.parent.children[node.keys[0]] is node and node.depth == node.parent.depth + len(node.keys)
    query = block_keys(data.draw(st.lists(st.integers(0, 2), max_size=10)), 1)
    expected = 0
    while expected < len(query) and query[expected] in cached:
        expected += 1
    path, matched = tree.walk(query)
    assert matched == expected
    assert sum(len(node.keys) for node in path[:-1]) < matched or not path


def test_depth_order_sorts_the_blocks_of_runs_shallowest_first_ties_in_the_order_given():
    tree = RadixTree()
    keys = block_keys(list(range(40)), 4)
    left = tree.add_child(tree.root, keys[:3], NodeState.ON_GPU, gpu_blocks=[0, 1, 2])  # depths 1..3
    other = block_keys([7] * 40, 4)
    right = tree.add_child(tree.root, other[:1], NodeState.ON_GPU, gpu_blocks=[3])
    deep = tree.add_child(right, other[1:4], NodeState.ON_GPU, gpu_blocks=[4, 5, 6])  # depths 2..4
    assert depth_order([left]) is None and depth_order([right, deep]) is None
    order = depth_order([deep, left])  # flat: 4, 5, 6 then 0, 1, 2
    flat = [4, 5, 6, 0, 1, 2]
    assert [flat[i] for i in order] == [0, 4, 1, 5, 2, 6]


def test_leaf_queue_pops_lru_then_deeper_and_skips_stale_entries():
    tree = RadixTree()
    keys = block_keys(list(range(16)), 4)
    nodes = []
    parent = tree.root
    for i, key in enumerate(keys):
        parent = tree.add_child(parent, [key], NodeState.ON_GPU, gpu_blocks=[i])
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
