"""Proposers: what drafts each speculating request's token tree for a step.

`DraftModelProposer` grows chains, static trees and dynamic EAGLE-2-style trees from one loop,
level by level, with a small draft model that shares the target's vocabulary and block ids.
`NgramProposer` drafts a chain from earlier occurrences of the context's last tokens (prompt
lookup) without any model. Both return `TokenTree`s and tell the scheduler how many KV slots a
request needs past its root (`spec_slots`), so the speculation can be chosen per step.

Draft KV layout for one request during a step (P = root position, the last committed token):

    | committed ... | root (P) | forwarded node 0 (P+1) | forwarded node 1 (P+2) | ...

Each level's draft forward re-runs every node forwarded so far (rows are nearly free next to
the weights), so the attention mask stays a plain per-forward tree mask. After verification the
accepted path's draft KV moves to P+1, P+2, ... like the target's, so the draft never recomputes
what it already has.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..engine.request import Request
from ..engine.scheduler import ScheduledRequest
from ..model.runner import ModelRunner, Segment
from ..sampling import process_logits
from .modes import DEFAULT_TREE_DEPTH, DEFAULT_TREE_TOPK, SpecMode
from .tree import children_lists, paths_to_parents
from .verify import TokenTree, Verdict


def spec_slots_for(mode: SpecMode, remaining_tokens: int) -> int:
    """KV slots past the root a request needs this step under `mode` (0: no speculation)."""
    if not mode.enabled or remaining_tokens <= 1:
        return 0
    if mode.kind in ("chain", "ngram"):
        return min(mode.num_tokens, remaining_tokens - 1)
    if mode.kind == "tree":
        # The tree keeps N nodes; the draft runs TOPK nodes on each level but the last.
        return max(mode.num_tokens, DEFAULT_TREE_TOPK * (DEFAULT_TREE_DEPTH - 1))
    return mode.num_tokens  # static


@dataclass
class _Growing:
    """One request's tree while the draft grows it."""

    req: Request
    mode: SpecMode
    budget: int  # most nodes (root excluded) and most forwarded nodes
    max_depth: int
    root: int  # root position P
    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    scores: list[float] = field(default_factory=lambda: [0.0])
    draft_rows: list[int] = field(default_factory=lambda: [-1])
    forwarded: list[int] = field(default_factory=list)  # node ids, in draft KV order
    pending: list[int] = field(default_factory=list)  # nodes whose logits the next forward yields
    expand: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> draft logits [V]
    probs: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> processed q [V]
    shape_children: list[list[int]] | None = None  # static: children of each shape node
    shape_node: list[int] = field(default_factory=lambda: [0])  # tree node -> shape node

    @property
    def greedy(self) -> bool:
        return self.req.params.greedy


class DraftModelProposer:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        # The latest propose()'s tree-growing forwards (catch-up excluded): adaptive's cost model.
        self.last_num_levels = 0
        self.last_levels_time_s = 0.0

    # ---- drafting -------------------------------------------------------------------------
    def propose(self, scheduled: Sequence[ScheduledRequest],
                modes: dict[str, SpecMode]) -> dict[str, TokenTree]:
        """Catch the draft up on every scheduled request and grow trees for those in `modes`.

        Prompt chunks go through the draft too (its KV must cover the prompt before it can
        propose); `modes` maps the request ids that speculate this step to their mode.
        """
        catch_up, growing = [], []
        for item in scheduled:
            req = item.request
            end = req.num_computed_tokens + item.num_new_tokens
            speculating = req.request_id in modes
            if req.num_draft_computed >= end:
                continue
            if not speculating and req.is_decoding:
                continue  # a decode step without speculation: the draft catches up later
            tokens = req.all_token_ids[req.num_draft_computed:end]
            catch_up.append(Segment(tokens, range(req.num_draft_computed, end),
                                    req.num_draft_computed, req.block_table,
                                    [len(tokens) - 1] if speculating else []))
            req.num_draft_computed = end
            if speculating:
                mode = modes[req.request_id]
                growing.append(self._start(req, mode, item.num_spec_slots))
        self.last_num_levels, self.last_levels_time_s = 0, 0.0
        if not catch_up:
            return {}
        logits = self.runner.forward(catch_up)
        roots = iter(lg[0] for seg, lg in zip(catch_up, logits) if seg.logit_rows)
        for g in growing:
            g.expand[0] = next(roots)
        for depth in range(1, max((g.max_depth for g in growing), default=0) + 1):
            for g in growing:
                if depth <= g.max_depth:
                    self._grow_level(g, depth)
            self._forward_pending([g for g in growing if g.pending])
        return {g.req.request_id: self._finish(g) for g in growing}

    def _start(self, req: Request, mode: SpecMode, budget: int) -> _Growing:
        max_depth = budget
        shape_children = None
        if mode.kind == "static":
            parents = paths_to_parents(mode.paths)[: budget + 1]
            shape_children = children_lists(parents)
        elif mode.kind == "tree":
            max_depth = DEFAULT_TREE_DEPTH
        max_depth = min(max_depth, req.remaining_tokens - 1)
        return _Growing(req, mode, budget, max_depth, req.num_tokens - 1,
                        [req.all_token_ids[-1]], shape_children=shape_children)

    def _grow_level(self, g: _Growing, depth: int) -> None:
        """Add the children of every node expanded at depth - 1; pick which to run next."""
        new_nodes = []
        for node in sorted(g.expand):
            logits = g.expand.pop(node)
            count = self._num_children(g, node)
            if count == 0:
                continue
            q = process_logits(logits[None], g.req.params)[0] if not g.greedy else None
            if q is not None:
                g.probs[node] = q
            tokens, logps = _pick_children(logits, q, count, g.req.generator)
            floor = g.scores[node]
            for k, (token, logp) in enumerate(zip(tokens, logps)):
                # Scores never increase along siblings, so pruning keeps a prefix of each
                # node's children: the order verification relies on when sampling.
                floor = min(floor, g.scores[node] + logp)
                g.tokens.append(token)
                g.parents.append(node)
                g.depths.append(depth)
                g.scores.append(floor)
                g.draft_rows.append(-1)
                if g.shape_children is not None:
                    g.shape_node.append(g.shape_children[g.shape_node[node]][k])
                new_nodes.append(len(g.tokens) - 1)
        if depth >= g.max_depth:
            return
        if g.mode.kind == "tree":
            new_nodes.sort(key=lambda i: -g.scores[i])
            new_nodes = new_nodes[:DEFAULT_TREE_TOPK]
        elif g.shape_children is not None:
            new_nodes = [i for i in new_nodes if g.shape_children[g.shape_node[i]]]
        room = g.budget - len(g.forwarded)
        for node in new_nodes[:room]:
            g.draft_rows[node] = len(g.forwarded)
            g.forwarded.append(node)
            g.pending.append(node)

    def _num_children(self, g: _Growing, node: int) -> int:
        if g.mode.kind == "tree":
            return DEFAULT_TREE_TOPK
        if g.shape_children is not None:
            return len(g.shape_children[g.shape_node[node]])
        return 1  # chain

    def _forward_pending(self, growing: list[_Growing]) -> None:
        if not growing:
            return
        start = time.perf_counter()
        segments = []
        for g in growing:
            fwd = g.forwarded
            rows = {node: r for r, node in enumerate(fwd)}
            mask = torch.zeros(len(fwd), len(fwd), dtype=torch.bool)
            for r, node in enumerate(fwd):
                a = node
                while a > 0:  # the root is below `start`: every row sees it as context
                    mask[r, rows[a]] = True
                    a = g.parents[a]
            segments.append(Segment([g.tokens[i] for i in fwd],
                                    [g.root + g.depths[i] for i in fwd], g.root + 1,
                                    g.req.block_table, [rows[i] for i in g.pending], mask))
        for g, logits in zip(growing, self.runner.forward(segments)):
            for node, row in zip(g.pending, logits):
                g.expand[node] = row
            g.pending = []
        self.last_num_levels += 1
        self.last_levels_time_s += time.perf_counter() - start

    def _finish(self, g: _Growing) -> TokenTree:
        keep = list(range(len(g.tokens)))
        size = min(g.mode.num_tokens, g.budget)
        if g.mode.kind == "tree" and len(keep) - 1 > size:
            # EAGLE-2 re-ranking: the N best nodes by cumulative draft log-probability. A child
            # never outscores its parent (ties broken by depth), so the set keeps its ancestors.
            best = sorted(keep[1:], key=lambda i: (-g.scores[i], g.depths[i], i))
            keep = [0] + sorted(best[:size], key=lambda i: (g.depths[i], i))
        else:
            keep.sort(key=lambda i: (g.depths[i], i))
        new_id = {old: new for new, old in enumerate(keep)}
        parents = [-1] + [new_id[g.parents[i]] for i in keep[1:]]
        prob_nodes = [i for i in keep if i in g.probs]
        prob_row = [prob_nodes.index(i) if i in g.probs else -1 for i in keep]
        return TokenTree(
            tokens=[g.tokens[i] for i in keep], parents=parents,
            draft_probs=torch.stack([g.probs[i] for i in prob_nodes]) if prob_nodes else None,
            prob_row=prob_row if prob_nodes else None,
            draft_rows=[g.draft_rows[i] for i in keep])

    # ---- after verification ---------------------------------------------------------------
    def after_verify(self, req: Request, tree: TokenTree, verdict: Verdict) -> None:
        """Keep the draft KV of accepted nodes: move it into place, drop the rest."""
        root = req.num_computed_tokens
        moves, kept = [], 0
        for depth, node in enumerate(verdict.accepted, start=1):
            j = tree.draft_rows[node]
            if j < 0:
                break
            moves.append((req.block_table, root + 1 + j, root + depth))
            kept += 1
        self.runner.move_kv(moves)
        req.num_draft_computed = root + 1 + kept


def _pick_children(logits: torch.Tensor, q: torch.Tensor | None, count: int,
                   generator: torch.Generator) -> tuple[list[int], list[float]]:
    """Children tokens of one node and their draft log-probabilities.

    Greedy: the top `count` by draft logit. Sampling: `count` draws from q without replacement
    (Gumbel-top-k gives them in draw order), which verification tries in that order.
    """
    logp = torch.log_softmax(logits.float(), -1) if q is None else q.log()
    if q is None:
        top = torch.topk(logp, count)
        return top.indices.tolist(), top.values.tolist()
    support = int((q > 0).sum())
    count = min(count, support)
    u = torch.rand(q.shape, generator=generator).clamp_min(1e-20)
    keys = logp - torch.log(-torch.log(u))
    order = torch.topk(keys, count).indices
    return order.tolist(), logp[order].tolist()


class NgramProposer:
    """Prompt lookup: propose the tokens that followed the latest earlier match of the context's
    last n tokens (n from `max_n` down to 1). No model, no KV."""

    def __init__(self, max_n: int = 3) -> None:
        self.max_n = max_n

    def propose(self, requests: Sequence[tuple[Request, int]]) -> dict[str, TokenTree]:
        trees = {}
        for req, budget in requests:
            draft = self.lookup(req.all_token_ids, budget)
            if draft:
                trees[req.request_id] = TokenTree(
                    tokens=[req.all_token_ids[-1]] + draft,
                    parents=list(range(-1, len(draft))),
                    draft_rows=[-1] * (len(draft) + 1))
        return trees

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), 0, -1):
            suffix = list(tokens[-n:])
            for start in range(len(tokens) - n - 1, -1, -1):
                if list(tokens[start:start + n]) == suffix:
                    return list(tokens[start + n:start + n + k])
        return []
