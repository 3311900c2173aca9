"""Suffix drafting: continue the context the way earlier text did, with no model.

SuffixDecoding (Oliaro et al. 2024) and vLLM's `suffix` method draft from a suffix structure over
the prompts and the server's own earlier outputs: multi-turn chats repeat their earlier turns,
clients resend the same questions, answers quote the prompt, code is rewritten with small edits.
Where the last tokens of a request occurred before, the tokens that followed them are a draft
that costs nothing to propose.

`SuffixStore` keeps recent token sequences (every request's prompt + output, the running ones
included, so a request also matches its own prompt) up to `max_tokens` in all, the oldest
finished ones evicted first. It indexes each position by the n-grams ending there (n in
`KEY_SIZES`), keeping the most recent `MAX_CANDIDATES` occurrences per n-gram. A lookup takes
the candidates of the longest key that occurred, measures each one's true match length (up to
`MAX_MATCH` tokens back), keeps the longest-matching ones and merges their continuations into a
trie whose nodes carry how many candidates pass through them. `draft_tree` turns the trie into a
`TokenTree` of at most `budget` nodes, best first by the candidates' agreement (a node's share
of the candidates, times its parent's), no deeper than `MATCH_FACTOR` x the match length: a
long match is trusted further than a short one.

Every proposal is verified by the target like any other (no draft distribution: a node is
accepted with the target's own probability), so the output is exactly the target's.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from .modes import SpecMode
from .proposers import Proposal, ProposerInput, _chain_slots
from .tree import TokenTree

KEY_SIZES = (2, 4, 8)  # n-gram lengths indexed; the longest that occurred is looked up first
MAX_CANDIDATES = 8  # most recent occurrences kept per n-gram
MAX_MATCH = 32  # a candidate's match length is measured this far back at most
MATCH_FACTOR = 2  # a tree reaches at most this many tokens per matched token
MIN_SHARE = 0.3  # a node whose candidates' share falls below this is not proposed
# Beside a draft model, a step drafts from the store instead when the match is at least this
# long and its tree's expected accepted tokens (the nodes' shares summed) reach MIN_SCORE:
# candidates that disagree are a worse guess than the draft's. Even a two-token match with one
# candidate gets about one token accepted (0.96 on first turns, 1.58 on second turns, of 4
# proposed: the default model, held-out questions), where the default model's draft gets a
# third; 2 and 1.0 against the 4 and 2.0 before, the default mode in one process (Zen 5,
# 6-8 held-out questions x 48 tokens): second turns 1.26x -> 1.32x `off`, first turns
# 0.94x -> 0.95x.
HYBRID_MIN_MATCH = 2
HYBRID_MIN_SCORE = 1.0
DEFAULT_STORE_TOKENS = 1 << 17  # about 40 MB of index and text


@dataclass
class SuffixMatch:
    """The continuations that follow the longest earlier occurrences of a context's suffix."""

    match_length: int  # tokens of the context matched (0: no match)
    continuations: list[list[int]]  # one per candidate, most recent first
    _shapes: dict[int, tuple[list[int], list[int], float]] = field(
        default_factory=dict, repr=False, compare=False)  # budget -> _shape(budget)

    def draft_tree(self, root_token: int, budget: int) -> tuple[TokenTree | None, float]:
        """The candidates' continuations as a tree of at most `budget` nodes (root excluded),
        and its score: the nodes' shares summed, the tokens it should get accepted if the
        candidates are a fair sample of what follows. (None, 0.0) when nothing clears
        MIN_SHARE."""
        if budget not in self._shapes:  # a step asks several times (mode, slots, proposal)
            self._shapes[budget] = self._shape(budget)
        tokens, parents, score = self._shapes[budget]
        if not tokens:
            return None, 0.0
        return _bfs_ordered([root_token, *tokens], [-1, *parents]), score

    def _shape(self, budget: int) -> tuple[list[int], list[int], float]:
        """draft_tree's nodes below the root: their tokens, parents (0: the root) and score."""
        max_depth = min(budget, MATCH_FACTOR * self.match_length)
        if not self.continuations or max_depth < 1:
            return [], [], 0.0
        trie = _Trie.of([c[:max_depth] for c in self.continuations])
        total = len(self.continuations)
        # Best-first over the trie: a node's score is the share of candidates that agree with
        # its whole path; parents always score at least their children, so BFS order holds.
        tokens, parents = [], []
        score = 0.0
        frontier = [(-count / total, order, token, 0, node)
                    for order, (token, (count, node)) in enumerate(trie.children(0).items())]
        heapq.heapify(frontier)
        order = len(frontier)
        while frontier and len(tokens) < budget:
            neg_score, _, token, parent, node = heapq.heappop(frontier)
            if -neg_score < MIN_SHARE:
                break
            tokens.append(token)
            parents.append(parent)
            score -= neg_score
            here = len(tokens)  # its index in the tree, the root being 0
            for child_token, (count, child) in trie.children(node).items():
                heapq.heappush(frontier, (neg_score * count / trie.count(node), order,
                                          child_token, here, child))
                order += 1
        return tokens, parents, score

    def beats_a_draft(self, budget: int) -> bool:
        """Whether to draft from the store rather than with a draft model this step."""
        return (self.match_length >= HYBRID_MIN_MATCH
                and self.draft_tree(0, budget)[1] >= HYBRID_MIN_SCORE)


class SuffixStore:
    """Recent token sequences, indexed by the n-grams ending at each position."""

    def __init__(self, max_tokens: int = DEFAULT_STORE_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._sequences: OrderedDict[str, list[int]] = OrderedDict()
        self._ids: dict[str, int] = {}  # sequence key -> its number in index entries
        self._keys: dict[int, str] = {}
        self._numbers = itertools.count()
        self._finished: set[str] = set()
        # hash of an n-gram -> where it ended: (sequence number << 32 | end), one int or a list
        # of them, oldest first (most n-grams occur once: no list for them). A hash collision
        # only yields a candidate whose measured match is short.
        self._table: dict[int, int | list[int]] = {}
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def update(self, key: str, tokens: Sequence[int]) -> None:
        """Sequence `key` is now `tokens` (it only ever grows; new ones are appended)."""
        seq = self._sequences.get(key)
        if seq is None:
            seq = self._sequences[key] = []
            number = self._ids[key] = next(self._numbers)
            self._keys[number] = key
        start = len(seq)
        if len(tokens) <= start:
            return
        seq.extend(tokens[start:])
        self._num_tokens += len(seq) - start
        self._index(key, seq, start)
        if self._num_tokens > self.max_tokens:
            self._evict()

    def clear(self) -> None:
        """Forget every sequence (benchmarks measure each prompt against an empty store)."""
        self.__init__(self.max_tokens)

    def finish(self, key: str) -> None:
        """The sequence no longer grows; it may be evicted, oldest first."""
        if key in self._sequences:
            self._finished.add(key)

    def match(self, key: str, context: Sequence[int]) -> SuffixMatch:
        """Continuations of the longest earlier occurrences of the end of `context` (sequence
        `key`'s own tokens included, except the occurrence at its end)."""
        for n in reversed(KEY_SIZES):
            if len(context) < n:
                continue
            hits = self._table.get(hash(tuple(context[-n:])))
            if hits is None:
                continue
            found = []  # (match length, recency, continuation)
            for recency, entry in enumerate(reversed([hits] if isinstance(hits, int) else hits)):
                seq_key, end = self._keys[entry >> 32], entry & 0xFFFFFFFF
                seq = self._sequences.get(seq_key)
                if seq is None or end >= len(seq) or (seq_key == key and end >= len(context)):
                    continue  # evicted, or nothing follows yet
                length = _match_length(seq, end, context)
                if length >= n:
                    found.append((length, recency, seq[end:]))
            if found:
                best = max(length for length, _, _ in found)
                return SuffixMatch(best, [c for length, _, c in sorted(found, key=lambda f: f[1])
                                          if length == best])
        return SuffixMatch(0, [])

    def _index(self, key: str, seq: list[int], start: int) -> None:
        table = self._table
        number = self._ids[key] << 32
        for end in range(start + 1, len(seq) + 1):  # the n-grams ending after `start`
            entry = number | end
            for n in KEY_SIZES:
                if end < n:
                    break
                h = hash(tuple(seq[end - n:end]))
                hits = table.get(h)
                if hits is None:
                    table[h] = entry
                elif isinstance(hits, int):
                    table[h] = [hits, entry]
                else:
                    hits.append(entry)
                    if len(hits) > 2 * MAX_CANDIDATES:  # trimmed in bulk: amortised O(1)
                        del hits[:-MAX_CANDIDATES]

    def _evict(self) -> None:
        """Drop the oldest finished sequences down to three quarters of the budget, then rebuild
        the index (amortised over the quarter of the budget that was added since)."""
        target = self.max_tokens * 3 // 4
        for key in [k for k in self._sequences if k in self._finished]:
            if self._num_tokens <= target:
                break
            self._num_tokens -= len(self._sequences.pop(key))
            self._finished.discard(key)
            del self._keys[self._ids.pop(key)]
        self._table = {}
        for key, seq in self._sequences.items():
            self._index(key, seq, 0)


class SuffixProposer:
    """Drafts from a `SuffixStore` shared by every request of the engine; no model, no KV.

    The engine asks `lookup` when it resolves a step's mode (the scheduler needs the size of
    the tree before the step) and `propose` returns the same trees; both only read the store,
    which changes when a request's tokens are recorded (`record`, once per step)."""

    def __init__(self, store: SuffixStore | None = None) -> None:
        self.store = store if store is not None else SuffixStore()
        self._last: dict[str, tuple[int, SuffixMatch]] = {}  # request -> (context length, match)

    def lookup(self, request_id: str, token_ids: Sequence[int]) -> SuffixMatch:
        """The match for a request's current context (recorded into the store first)."""
        cached = self._last.get(request_id)
        if cached is not None and cached[0] == len(token_ids):
            return cached[1]
        self.store.update(request_id, token_ids)
        found = self.store.match(request_id, token_ids)
        self._last[request_id] = (len(token_ids), found)
        return found

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None:
        """A request left the engine: its whole text stays in the store for later ones."""
        self.store.update(request_id, token_ids)
        self.store.finish(request_id)
        self._last.pop(request_id, None)

    def spec_slots(self, mode: SpecMode, remaining_tokens: int) -> int:
        return _chain_slots(mode, remaining_tokens)  # a tree of up to K nodes, as a chain's K

    def propose(self, inputs: Sequence[ProposerInput]) -> Proposal:
        proposal = Proposal()
        for inp in inputs:
            if not inp.num_spec_slots:
                continue
            tree, _ = self.lookup(inp.request_id, inp.token_ids).draft_tree(inp.token_ids[-1],
                                                                            inp.num_spec_slots)
            if tree is not None:
                proposal.trees[inp.request_id] = tree
        return proposal

    def after_verify(self, block_table, root, tree, verdict) -> None:
        return None  # no model, no KV


class _Trie:
    """Token tries with a candidate count per node; node 0 is the root."""

    def __init__(self) -> None:
        self._children: list[dict[int, int]] = [{}]
        self._counts: list[int] = [0]

    @classmethod
    def of(cls, sequences: Sequence[Sequence[int]]) -> _Trie:
        trie = cls()
        for seq in sequences:
            node = 0
            trie._counts[0] += 1
            for token in seq:
                child = trie._children[node].get(token)
                if child is None:
                    child = trie._children[node][token] = len(trie._children)
                    trie._children.append({})
                    trie._counts.append(0)
                trie._counts[child] += 1
                node = child
        return trie

    def count(self, node: int) -> int:
        return self._counts[node]

    def children(self, node: int) -> dict[int, tuple[int, int]]:
        """token -> (count, child node)."""
        return {t: (self._counts[c], c) for t, c in self._children[node].items()}


def _match_length(seq: Sequence[int], end: int, context: Sequence[int]) -> int:
    """How many tokens before `end` in `seq` equal the last tokens of `context`."""
    n = 0
    limit = min(MAX_MATCH, end, len(context))
    while n < limit and seq[end - 1 - n] == context[len(context) - 1 - n]:
        n += 1
    return n


def _bfs_ordered(tokens: list[int], parents: list[int]) -> TokenTree:
    """A tree in the engine's node order (parents before children, by depth)."""
    depth = [0] * len(tokens)
    for i in range(1, len(tokens)):
        depth[i] = depth[parents[i]] + 1
    order = sorted(range(len(tokens)), key=lambda i: (depth[i], i))
    new_id = {old: new for new, old in enumerate(order)}
    return TokenTree(tokens=[tokens[i] for i in order],
                     parents=[-1] + [new_id[parents[i]] for i in order[1:]],
                     draft_rows=[-1] * len(tokens))
