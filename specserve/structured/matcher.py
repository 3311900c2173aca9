"""One request's grammar state during speculation: masks at tree nodes, pruning, commits.

The xgrammar matcher always sits at the request's committed output. A tree node's mask (the
tokens the grammar allows after the root-to-node path) is found by advancing the matcher along
the path, filling the bitmask and rolling back; masks are kept per path for the step, so the
draft (which asks while it grows the tree) and verification (which asks for every node) share
them. The same mask is applied to the draft's and to the target's logits before any other
processing, so:
- greedy: each node's target argmax is the argmax a target-only constrained run takes in that
  state, hence speculative output == non-speculative output;
- sampling: the draft's q is drawn from the masked draft distribution, the target's p is the
  masked target distribution, and rejection sampling keeps p exactly.
A proposer that ignores the grammar (n-gram lookup) is handled by `prune`: a node the grammar
rejects is dropped with its subtree before the target sees the tree (its proposal is
deterministic, so dropping nodes keeps verification exact).
"""

from __future__ import annotations

import torch
import xgrammar as xgr

from ..speculation.tree import TokenTree

# Bit j of a bitmask word; 1 << 31 wraps to INT32_MIN, the same bit pattern.
_BITS = (1 << torch.arange(32, dtype=torch.int64)).to(torch.int32)  # [32]


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's bitmask [n, ceil(V / 32)] int32 -> allowed [n, vocab_size] bool."""
    n = bitmask.shape[0]
    bits = (bitmask.unsqueeze(-1) & _BITS) != 0  # [n, W, 32]
    return bits.view(n, -1)[:, :vocab_size]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int
                  ) -> torch.Tensor:
    """logits [n, V'] -> a float32 copy with the tokens the bitmask [n, W] disallows at -inf.

    Fast path: xgrammar's CPU kernel reads the bits in place (2-3x faster than unpacking them
    to booleans first, measured at V = 49,152). Fallback, for logits wider than the grammar's
    vocabulary (a model that pads its embedding further than its draft's): unpack, and never
    allow the padding.
    """
    if logits.shape[-1] == vocab_size:
        out = logits.to(torch.float32, copy=True)
        xgr.apply_token_bitmask_inplace(out, bitmask)
        return out
    allowed = unpack_bitmask(bitmask, min(vocab_size, logits.shape[-1]))  # [n, V]
    out = torch.full(logits.shape, float("-inf"))
    vocab = allowed.shape[-1]
    out[..., :vocab] = logits[..., :vocab].float().masked_fill(~allowed, float("-inf"))
    return out


class RequestGrammar:
    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)  # unbounded rollback
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        # path after the root -> its bitmask row [W] int32 (None: the grammar rejects the path)
        self._rows: dict[tuple[int, ...], torch.Tensor | None] = {}

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        return self.matcher.is_terminated()

    # ---- masks ----------------------------------------------------------------------------
    def row(self, path: tuple[int, ...]) -> torch.Tensor | None:
        """The bitmask row [W] after the committed output + path (None: path rejected)."""
        if path in self._rows:
            return self._rows[path]
        accepted, past_stop = 0, False
        for token in path:
            if self.matcher.is_terminated():
                past_stop = True
                break
            if not self.matcher.accept_token(token):
                break
            accepted += 1
        row = None
        if past_stop or accepted == len(path):
            if past_stop or self.matcher.is_terminated():
                # Past a stop token nothing is committed (the request ends there); allow
                # everything, so rows after it stay proper distributions (never all -inf).
                row = torch.full((self._words,), -1, dtype=torch.int32)
            else:
                bitmask = torch.empty((1, self._words), dtype=torch.int32)
                self.matcher.fill_next_token_bitmask(bitmask, 0)
                row = bitmask[0]
        if accepted:
            self.matcher.rollback(accepted)
        self._rows[path] = row
        return row

    def allows(self, path: tuple[int, ...], token: int) -> bool:
        """Whether the grammar lets `token` follow the committed output + path."""
        row = self.row(path)
        return row is not None and 0 <= token < self.vocab_size and \
            bool((int(row[token >> 5]) >> (token & 31)) & 1)

    def masked_draft_logits(self, logits: torch.Tensor, tokens: list[int], parents: list[int],
                            node: int) -> torch.Tensor:
        """A growing tree's draft logits [V'] at `node`, disallowed tokens at -inf, so the
        draft proposes only tokens the grammar allows (its q is the masked distribution)."""
        row = self.row(_path(tokens, parents, node))
        if row is None:  # a greedy draft's -inf child: pruned before verification anyway
            return logits
        return apply_bitmask(logits[None], row[None], self.vocab_size)[0]

    def prune(self, tree: TokenTree) -> TokenTree:
        """The tree without the nodes the grammar rejects (and their subtrees)."""
        paths: list[tuple[int, ...] | None] = [()]
        for i in range(1, len(tree)):
            parent = paths[tree.parents[i]]
            ok = parent is not None and self.allows(parent, tree.tokens[i])
            paths.append(parent + (tree.tokens[i],) if ok else None)
        keep = [i for i, p in enumerate(paths) if p is not None]
        if len(keep) == len(tree):
            return tree
        new_id = {old: new for new, old in enumerate(keep)}
        return TokenTree(
            tokens=[tree.tokens[i] for i in keep],
            parents=[-1] + [new_id[tree.parents[i]] for i in keep[1:]],
            draft_probs=tree.draft_probs,  # rows stay where prob_row points
            prob_row=[tree.prob_row[i] for i in keep] if tree.prob_row is not None else None,
            draft_rows=[tree.draft_rows[i] for i in keep] if tree.draft_rows is not None
            else None)

    def tree_bitmask(self, tree: TokenTree) -> torch.Tensor:
        """[n, W] int32: the tokens the grammar allows after each node of a pruned tree."""
        return torch.stack([self.row(_path(tree.tokens, tree.parents, i))
                            for i in range(len(tree))])

    # ---- commits --------------------------------------------------------------------------
    def commit(self, token: int) -> bool:
        """Advance past a committed token; True once the grammar has accepted a stop token
        (the output is complete). The step's path masks are stale after this."""
        self._rows.clear()
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            raise RuntimeError(f"structured output: committed token {token} is not allowed by "
                               f"the grammar (a mask was not applied)")
        return self.matcher.is_terminated()


def _path(tokens: list[int], parents: list[int], node: int) -> tuple[int, ...]:
    """The tokens from below the root down to `node` (the root is already committed)."""
    path = []
    while node > 0:
        path.append(tokens[node])
        node = parents[node]
    return tuple(reversed(path))
