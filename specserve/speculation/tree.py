"""Token trees as data, and the one function that turns any tree into tree buffers.

A tree is a list of parents in breadth-first order: node 0 is the root (the last committed
token, parent -1) and every other node's parent comes before it. Siblings keep the order the
proposer ranked them in, which is the order verification tries them.

Static shapes are written as Medusa writes them: each node is the path of child indices from the
root, `[[0], [1], [0, 0]]` = two children of the root and one grandchild under the first.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Distinct tree shapes whose mask and buffers are kept: a step's trees repeat a few shapes (a
# chain of k, a static tree), and building them from the parents list took 0.14-0.27 ms a step
# (2-8 nodes, a 2-vCPU Zen 3), 5% of a chain:1 step on the default model; a kept one costs a
# dictionary lookup.
SHAPES_KEPT = 1024

# Named static shapes shipped with the package (child-index paths; root implicit).
STATIC_TREES: dict[str, list[list[int]]] = {
    # A spine of 5 with a second guess at the first two levels.
    "small": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]],
    # Wider near the root, where the draft is least sure; 16 nodes, depth 6.
    "medium": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0],
               [1, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0],
               [0, 0, 0, 1]],
}


@dataclass
class TokenTree:
    """One request's proposal for one step, BFS-ordered (see above); node 0 is the root."""

    tokens: list[int]  # [n]
    parents: list[int]  # [n]
    draft_probs: torch.Tensor | None = None  # [m, V] float32 q at expanded nodes; None: no q
    prob_row: list[int] | None = None  # [n] row of draft_probs for each node, -1 if none
    draft_rows: list[int] | None = None  # [n] draft forward index (KV at root + 1 + j), -1 if none

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class TreeBuffers:
    """What a tree turns into for the kernels and the verifier (n nodes, root included)."""

    parents: torch.Tensor  # [n] int64, -1 for the root
    depths: torch.Tensor  # [n] int64, 0 for the root
    tree_mask: torch.Tensor  # [n, n] bool: node i sees node j iff j is i or an ancestor of i
    retrieve_indices: torch.Tensor  # [leaves, max_depth + 1] int64: root-to-leaf paths, -1 pad

    def positions(self, root_position: int) -> torch.Tensor:
        """[n] rotary positions: committed length + depth."""
        return self.depths + root_position


def validate_paths(paths: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Check a Medusa-style shape: non-empty paths whose prefixes and earlier siblings exist."""
    shape = {tuple(p) for p in paths}
    if not shape or len(shape) != len(paths):
        raise ValueError("a static tree needs at least one path and no duplicates")
    for p in shape:
        if not p or any(not isinstance(c, int) or c < 0 for c in p):
            raise ValueError(f"bad tree path {list(p)}: child indices must be ints >= 0")
        if len(p) > 1 and p[:-1] not in shape:
            raise ValueError(f"tree path {list(p)} has no parent {list(p[:-1])}")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in shape:
            raise ValueError(f"tree path {list(p)} skips sibling {p[-1] - 1}")
    return tuple(sorted(shape, key=lambda p: (len(p), p)))


def paths_to_parents(paths: Sequence[Sequence[int]]) -> list[int]:
    """Medusa paths -> parents list in BFS order, root included as node 0."""
    ordered = validate_paths(paths)
    index = {(): 0}
    parents = [-1]
    for p in ordered:
        index[p] = len(parents)
        parents.append(index[p[:-1]])
    return parents


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node of a BFS-ordered parents list (the root's is 0)."""
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


def tree_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool: node i sees node j iff j is i or an ancestor of i (BFS-ordered parents;
    a parent of -1 marks a node whose ancestors are outside the mask). Shared between calls
    with the same parents: read it, never write it."""
    return _tree_mask(tuple(parents))


@functools.lru_cache(maxsize=SHAPES_KEPT)
def _tree_mask(parents: tuple[int, ...]) -> torch.Tensor:
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(n):
        if parents[i] >= 0:
            mask[i] |= mask[parents[i]]
    return mask


def build_tree_buffers(parents: Sequence[int]) -> TreeBuffers:
    """The tree buffers of a BFS-ordered parents list (parents[0] == -1, parents[i] < i).
    Shared between calls with the same parents, as tree_mask's are: read them, never write."""
    return _tree_buffers(tuple(parents))


@functools.lru_cache(maxsize=SHAPES_KEPT)
def _tree_buffers(parents: tuple[int, ...]) -> TreeBuffers:
    n = len(parents)
    if n == 0 or parents[0] != -1 or any(not 0 <= parents[i] < i for i in range(1, n)):
        raise ValueError(f"parents must start with -1 and point backwards, got {list(parents)}")
    depths = node_depths(parents)
    mask = tree_mask(parents)
    has_child = [False] * n
    for i in range(1, n):
        has_child[parents[i]] = True
    leaves = [i for i in range(n) if not has_child[i]]
    max_depth = max(depths)
    retrieve = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.int64)
    for row, leaf in enumerate(leaves):
        path = mask[leaf].nonzero().flatten()  # ancestors in BFS order are by depth too
        retrieve[row, : len(path)] = path
    return TreeBuffers(torch.tensor(parents, dtype=torch.int64),
                       torch.tensor(depths, dtype=torch.int64), mask, retrieve)


def children_lists(parents: Sequence[int]) -> list[list[int]]:
    """children[i] = node i's children in sibling (verification) order."""
    children: list[list[int]] = [[] for _ in parents]
    for i in range(1, len(parents)):
        children[parents[i]].append(i)
    return children
