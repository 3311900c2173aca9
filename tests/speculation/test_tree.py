"""Tree buffers for hand-drawn trees, and speculation spellings."""

from __future__ import annotations

import pytest
import torch

from specserve.speculation.modes import parse_speculation
from specserve.speculation.tree import (
    STATIC_TREES,
    build_tree_buffers,
    children_lists,
    paths_to_parents,
    tree_mask,
)


def test_hand_drawn_tree():
    #        0 (root)
    #       / \
    #      1   2
    #     / \    \
    #    3   4    5
    #    |
    #    6
    parents = paths_to_parents([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert parents == [-1, 0, 0, 1, 1, 2, 3]
    buf = build_tree_buffers(parents)
    assert buf.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert buf.positions(10).tolist() == [10, 11, 11, 12, 12, 12, 13]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(buf.tree_mask, expected)
    assert buf.retrieve_indices.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    assert children_lists(parents) == [[1, 2], [3, 4], [5], [6], [], [], []]


def test_chain_buffers():
    buf = build_tree_buffers([-1, 0, 1, 2])
    assert torch.equal(buf.tree_mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert buf.retrieve_indices.tolist() == [[0, 1, 2, 3]]


def test_a_shape_is_built_once_and_a_bad_one_is_refused_every_time():
    """Steps repeat a few tree shapes: the buffers and masks of one are kept (by value of the
    parents, list or tuple alike), distinct shapes get their own, and a bad list is never
    kept."""
    chain = build_tree_buffers([-1, 0, 1])
    assert build_tree_buffers((-1, 0, 1)) is chain
    fork = build_tree_buffers([-1, 0, 0])
    assert fork is not chain and fork.tree_mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
    assert tree_mask([-1, 0, 1]) is tree_mask((-1, 0, 1))
    assert torch.equal(tree_mask([-1, 0, 1]), chain.tree_mask)
    assert tree_mask([-1, -1, 1]).tolist() == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]
    for _ in range(2):
        with pytest.raises(ValueError, match="point backwards"):
            build_tree_buffers([-1, 1, 0])


@pytest.mark.parametrize("bad", [[[1]], [[0, 0]], [[0], [0]], [[-1]], []])
def test_bad_static_paths(bad):
    with pytest.raises(ValueError):
        paths_to_parents(bad)


def test_named_static_trees_are_valid():
    for name, paths in STATIC_TREES.items():
        assert len(paths_to_parents(paths)) == len(paths) + 1, name


def test_speculation_spellings():
    assert parse_speculation(None, has_draft=False).kind == "off"
    cpu_default = parse_speculation(None, has_draft=True)  # see best_mode
    assert cpu_default.kind == "suffix" and cpu_default.fallback.kind == "adaptive"
    assert str(cpu_default) == "suffix:8+adaptive"
    assert parse_speculation(None, has_draft=True, device="cuda:0").kind == "tree"
    assert str(parse_speculation("chain:4", True)) == "chain:4"
    assert parse_speculation("tree:32", True).num_tokens == 32
    assert parse_speculation("static:small", True).kind == "static"
    assert parse_speculation([[0], [0, 0], [1]], True).num_tokens == 3
    assert parse_speculation("ngram:3", False).kind == "ngram"
    with pytest.raises(ValueError, match="needs a draft model"):
        parse_speculation("chain:4", has_draft=False)
    with pytest.raises(ValueError, match="unknown speculation"):
        parse_speculation("fast", True)
    with pytest.raises(ValueError, match="chain size"):
        parse_speculation("chain:0", True)
