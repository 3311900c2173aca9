"""Proposers: what drafts each speculating request's token tree for a step.

`DraftModelProposer` grows chains, static trees and dynamic EAGLE-2-style trees from one loop,
level by level, with a small draft model that shares the target's vocabulary and block ids.
An EAGLE-style draft (`spec.reads_target_hidden`) reads, beside each token, the target's final
hidden state at the previous position (`target_hidden.py`), and inside a tree its parent node's
own output state in its place. `NgramProposer` drafts a chain from earlier occurrences of the
context's last tokens (prompt lookup) without any model. Both implement the `Proposer` protocol
the engine drives: how many KV slots a request needs past its root (`spec_slots`, so the
speculation can be chosen per step), `propose` (a `Proposal`: token trees, and how far the draft
KV now reaches) and `after_verify` (how far the draft KV reaches once the accepted path's KV is
in place). Proposers see a request only through `ProposerInput` and never write engine state:
the engine owns KV progress.

Draft KV layout for one request during a step (P = root position, the last committed token):

    | committed ... | root (P) | forwarded node 0 (P+1) | forwarded node 1 (P+2) | ...

Each level's draft forward re-runs every node forwarded so far (rows are nearly free next to
the weights), so the attention mask stays a plain per-forward tree mask. After verification the
accepted path's draft KV moves to P+1, P+2, ... like the target's, so the draft never recomputes
what it already has (an EAGLE-style draft recomputes it from the target's states instead).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..model.runner import ModelRunner, Segment
from ..sampling import SamplingParams, argmax_rows, process_logits
from .modes import DEFAULT_TREE_DEPTH, DEFAULT_TREE_TOPK, SpecKind, SpecMode
from .target_hidden import TargetHiddenStore
from .tree import TokenTree, children_lists, paths_to_parents, tree_mask
from .verify import Verdict


@dataclass
class ProposerInput:
    """One scheduled request as a proposer sees it for one step."""

    request_id: str
    token_ids: list[int]  # prompt + output so far; the last one is the root
    block_table: list[int]
    params: SamplingParams
    generator: torch.Generator
    num_computed_tokens: int  # tokens with target KV before this step
    num_draft_computed: int  # tokens with draft KV before this step
    num_new_tokens: int  # committed tokens the target computes this step
    is_decoding: bool  # only the root lacks target KV
    remaining_tokens: int  # tokens the request may still commit
    num_spec_slots: int  # KV slots past the root reserved for a tree (0: no speculation)
    mode: SpecMode  # the mode this step (adaptive already resolved)
    # Structured output (specserve.structured.matcher.RequestGrammar): the draft proposes only
    # tokens it allows at each node. None: unconstrained.
    grammar: object | None = None


@dataclass
class Proposal:
    """What one `propose` call produced."""

    trees: dict[str, TokenTree] = field(default_factory=dict)  # request id -> tree
    # Request id -> tokens whose draft KV is now in place (only requests whose draft KV grew).
    draft_computed: dict[str, int] = field(default_factory=dict)
    # Draft forwards of a drafting step, and their time: the draft cost adaptive speculation
    # measures. A steady drafting step counts its whole draft stage (the catch-up forward that
    # yields depth 1, the deeper levels' forwards and the picks between them); one whose
    # catch-up carried more than the tokens the last drafting step committed (prompt chunks,
    # tokens of steps without drafts) counts its deeper levels' forwards alone.
    num_levels: int = 0
    levels_time_s: float = 0.0


class Proposer(Protocol):
    def spec_slots(self, mode: SpecMode, remaining_tokens: int) -> int:
        """KV slots past the root a request needs this step under `mode` (0: none)."""

    def propose(self, inputs: Sequence[ProposerInput]) -> Proposal:
        """Trees for the inputs with spec slots; the rest only catch their draft KV up."""

    def after_verify(self, block_table: list[int], root: int, tree: TokenTree,
                     verdict: Verdict) -> int | None:
        """Move the accepted path's draft KV behind the root (at position `root`); return how
        many tokens have draft KV now, or None for a proposer that keeps no KV."""


def _chain_slots(mode: SpecMode, remaining_tokens: int) -> int:
    if not mode.enabled or remaining_tokens <= 1:
        return 0
    return min(mode.num_tokens, remaining_tokens - 1)


@dataclass
class _Growing:
    """One request's tree while the draft grows it."""

    inp: ProposerInput
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
    # EAGLE-style drafts: node -> the draft's output hidden state [H], which its children read
    # in place of the target's
    node_hidden: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.inp.params.greedy


class DraftModelProposer:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        spec = runner.model.spec
        ids = runner.model.head_token_ids
        # The token of each logits row's column, where the runner returns a reduced head's own
        # rows (greedy picks read them as they are; None: the column is the token).
        self.column_tokens = ids.tolist() if runner.head_rows and ids is not None else None
        # An EAGLE-style draft reads the target's hidden states beside its tokens; the engine
        # hands them over with `record_target_hidden` after each target forward.
        self.target_hidden = (TargetHiddenStore(spec.hidden_size) if spec.reads_target_hidden
                              else None)

    @property
    def reads_target_hidden(self) -> bool:
        return self.target_hidden is not None

    def record_target_hidden(self, request_id: str, first_position: int,
                             hidden: torch.Tensor) -> None:
        """The target's hidden rows at positions first_position, +1, ...: its final states
        [n, H], with its tapped layers' outputs beside them for a draft with
        `target_feature_layers` [n, (1 + k) H], kept as the draft reads them (fused)."""
        self.target_hidden.record(request_id, first_position,
                                  self.runner.model.fuse_target_features(hidden))

    def forget(self, request_id: str) -> None:
        """A request left the engine."""
        if self.target_hidden is not None:
            self.target_hidden.forget(request_id)

    def spec_slots(self, mode: SpecMode, remaining_tokens: int) -> int:
        if mode.kind is SpecKind.TREE and remaining_tokens > 1:
            # The tree keeps N nodes; the draft runs TOPK nodes on each level but the last.
            return max(mode.num_tokens, DEFAULT_TREE_TOPK * (DEFAULT_TREE_DEPTH - 1))
        if mode.kind is SpecKind.STATIC and remaining_tokens > 1:
            return mode.num_tokens
        return _chain_slots(mode, remaining_tokens)

    # ---- drafting -------------------------------------------------------------------------
    def propose(self, inputs: Sequence[ProposerInput]) -> Proposal:
        """Catch the draft up on every input and grow trees for those with spec slots.

        Prompt chunks go through the draft too (its KV must cover the prompt before it can
        propose).
        """
        began = time.perf_counter()
        proposal = Proposal()
        catch_up, growing = [], []
        steady = True  # the catch-up is one that every drafting step has (timed, see below)
        for inp in inputs:
            end = inp.num_computed_tokens + inp.num_new_tokens
            speculating = inp.num_spec_slots > 0
            if self.target_hidden is not None:
                # Position p reads the target's state at p - 1: the draft reaches only as far as
                # the target has computed (a prompt chunk one step after the target's forward).
                reach = min(end, self.target_hidden.reach(inp.request_id))
                speculating = speculating and reach == end
                end = reach
            if inp.num_draft_computed >= end:
                continue
            if not speculating and inp.is_decoding:
                continue  # a decode step without speculation: the draft catches up later
            start = inp.num_draft_computed
            tokens = inp.token_ids[start:end]
            rows = [len(tokens) - 1] if speculating else []
            catch_up.append(Segment(tokens, range(start, end), start, inp.block_table, rows,
                                    hidden_rows=rows if self.target_hidden is not None else (),
                                    target_hidden=self._read_target_hidden(inp.request_id,
                                                                           start, end)))
            proposal.draft_computed[inp.request_id] = end
            # Longer catch-ups carry a prompt chunk or tokens of steps that did not draft.
            steady = steady and inp.is_decoding and len(tokens) <= inp.num_spec_slots + 1
            if speculating:
                growing.append(self._start(inp))
        if not catch_up:
            return proposal
        hidden: list[torch.Tensor] = []
        logits = self.runner.forward(catch_up, hidden)
        roots = iter((lg, hid) for seg, lg, hid in zip(catch_up, logits, hidden)
                     if seg.logit_rows)
        for g in growing:
            lg, hid = next(roots)
            g.expand[0] = lg[0]
            if len(hid):
                g.node_hidden[0] = hid[0]
        for depth in range(1, max((g.max_depth for g in growing), default=0) + 1):
            for g in growing:
                if depth <= g.max_depth:
                    self._grow_level(g, depth)
            self._forward_pending([g for g in growing if g.pending], proposal)
        proposal.trees = {g.inp.request_id: self._finish(g) for g in growing}
        if growing and steady:
            # The catch-up is the depth-1 forward of every chain (a chain:1's only one), and the
            # Python around the forwards is a good part of a small draft's level: a chain:1's
            # forward took 0.53 of its 0.64 ms draft stage (the default model, Zen 5).
            proposal.num_levels += 1
            proposal.levels_time_s = time.perf_counter() - began
        return proposal

    def _read_target_hidden(self, request_id: str, start: int, end: int
                            ) -> torch.Tensor | None:
        """[end - start, H] what positions start..end-1 read; the rows before end - 1 are then
        done with (position end reads the row of end - 1)."""
        if self.target_hidden is None:
            return None
        rows = self.target_hidden.inputs(request_id, start, end)
        self.target_hidden.drop_before(request_id, end - 1)
        return rows

    def _start(self, inp: ProposerInput) -> _Growing:
        mode, budget = inp.mode, inp.num_spec_slots
        max_depth = budget
        shape_children = None
        if mode.kind is SpecKind.STATIC:
            parents = paths_to_parents(mode.paths)[: budget + 1]
            shape_children = children_lists(parents)
        elif mode.kind is SpecKind.TREE:
            max_depth = DEFAULT_TREE_DEPTH
        max_depth = min(max_depth, inp.remaining_tokens - 1)
        return _Growing(inp, mode, budget, max_depth, len(inp.token_ids) - 1,
                        [inp.token_ids[-1]], shape_children=shape_children)

    def _grow_level(self, g: _Growing, depth: int) -> None:
        """Add the children of every node expanded at depth - 1; pick which to run next."""
        new_nodes = []
        for node in sorted(g.expand):
            logits = g.expand.pop(node)  # [runner.logit_width]
            count = self._num_children(g, node)
            if count == 0:
                continue
            in_columns = self.column_tokens is not None  # the head's rows, not the vocabulary
            by_column = in_columns and g.greedy and g.inp.grammar is None
            if in_columns and not by_column:
                # Grammar masks and the sampled q live on the whole vocabulary (verification
                # compares q with the target's distribution there).
                logits = self.runner.model.vocab_logits(logits[None])[0]  # [vocab]
            if g.inp.grammar is not None:
                logits = g.inp.grammar.masked_draft_logits(logits, g.tokens, g.parents, node)
            q = process_logits(logits[None], g.inp.params)[0] if not g.greedy else None
            if q is not None:
                g.probs[node] = q
            tokens, logps = _pick_children(logits, q, count, g.inp.generator,
                                           scored=g.mode.kind is SpecKind.TREE)
            if by_column:
                tokens = [self.column_tokens[t] for t in tokens]
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
        if g.mode.kind is SpecKind.TREE:
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
        if g.mode.kind is SpecKind.TREE:
            return DEFAULT_TREE_TOPK
        if g.shape_children is not None:
            return len(g.shape_children[g.shape_node[node]])
        return 1  # chain

    def _forward_pending(self, growing: list[_Growing], proposal: Proposal) -> None:
        if not growing:
            return
        start = time.perf_counter()
        segments = []
        for g in growing:
            fwd = g.forwarded
            rows = {node: r for r, node in enumerate(fwd)}
            # The root is below `start`: every row sees it as context, so it is no mask row.
            mask = tree_mask([rows.get(g.parents[node], -1) for node in fwd])
            wanted = [rows[i] for i in g.pending]
            # A hidden-reading draft: each node reads its parent's output state [n, H].
            parent_hidden = (torch.stack([g.node_hidden[g.parents[i]] for i in fwd])
                             if self.target_hidden is not None else None)
            segments.append(Segment([g.tokens[i] for i in fwd],
                                    [g.root + g.depths[i] for i in fwd], g.root + 1,
                                    g.inp.block_table, wanted, mask,
                                    hidden_rows=wanted if parent_hidden is not None else (),
                                    target_hidden=parent_hidden))
        hidden: list[torch.Tensor] = []
        logits = self.runner.forward(segments, hidden)
        for g, rows_logits, hid in zip(growing, logits, hidden):
            for i, (node, row) in enumerate(zip(g.pending, rows_logits)):
                g.expand[node] = row
                if len(hid):
                    g.node_hidden[node] = hid[i]
            g.pending = []
        proposal.num_levels += 1
        proposal.levels_time_s += time.perf_counter() - start

    def _finish(self, g: _Growing) -> TokenTree:
        keep = list(range(len(g.tokens)))
        size = min(g.mode.num_tokens, g.budget)
        if g.mode.kind is SpecKind.TREE and len(keep) - 1 > size:
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
    def after_verify(self, block_table: list[int], root: int, tree: TokenTree,
                     verdict: Verdict) -> int:
        """Keep the draft KV of accepted nodes: move it into place, drop the rest."""
        if self.target_hidden is not None:
            # The accepted nodes' draft KV was computed from the draft's own states; the next
            # catch-up recomputes it from the target's (the root's KV already is).
            return root + 1
        moves, kept = [], 0
        for depth, node in enumerate(verdict.accepted, start=1):
            j = tree.draft_rows[node]
            if j < 0:
                break
            moves.append((block_table, root + 1 + j, root + depth))
            kept += 1
        self.runner.move_kv(moves)
        return root + 1 + kept


def _pick_children(logits: torch.Tensor, q: torch.Tensor | None, count: int,
                   generator: torch.Generator, scored: bool = True
                   ) -> tuple[list[int], list[float]]:
    """Children tokens of one node and their draft log-probabilities.

    Greedy: the top `count` by draft logit; without `scored` (a shape that no score decides:
    every mode but a tree), their log-probabilities are left at 0, which saves a reduction over
    the logits on every drafted level. Sampling: `count` draws from q without replacement
    (Gumbel-top-k gives them in draw order), which verification tries in that order.
    """
    if q is None:
        if count == 1 and not scored:
            return argmax_rows(logits[None]), [0.0]
        logits = logits.float()
        top = torch.topk(logits, count)
        if not scored:
            return top.indices.tolist(), [0.0] * count
        # the log-softmax of the top `count` alone: a pass less over the logits
        return top.indices.tolist(), (top.values - torch.logsumexp(logits, -1)).tolist()
    logp = q.log()
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

    def spec_slots(self, mode: SpecMode, remaining_tokens: int) -> int:
        return _chain_slots(mode, remaining_tokens)

    def propose(self, inputs: Sequence[ProposerInput]) -> Proposal:
        proposal = Proposal()
        for inp in inputs:
            draft = self.lookup(inp.token_ids, inp.num_spec_slots) if inp.num_spec_slots else []
            if draft:
                proposal.trees[inp.request_id] = TokenTree(
                    tokens=[inp.token_ids[-1]] + draft,
                    parents=list(range(-1, len(draft))),
                    draft_rows=[-1] * (len(draft) + 1))
        return proposal

    def after_verify(self, block_table: list[int], root: int, tree: TokenTree,
                     verdict: Verdict) -> None:
        return None  # no model, no KV

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), 0, -1):
            suffix = list(tokens[-n:])
            for start in range(len(tokens) - n - 1, -1, -1):
                if list(tokens[start:start + n]) == suffix:
                    return list(tokens[start + n:start + n + k])
        return []
