"""Suffix drafting: the store's matches, the trees it proposes, and the engine's use of it
(exactness of every suffix mode is in test_spec_greedy.py and test_spec_sampling.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve import LLM, SamplingParams
from specserve.speculation import suffix
from specserve.speculation.adaptive import MAX_CHAIN
from specserve.speculation.modes import SpecKind
from specserve.speculation.suffix import SuffixMatch, SuffixProposer, SuffixStore
from specserve.speculation.tree import children_lists


def test_longest_match_wins_and_its_continuations_come_most_recent_first():
    store = SuffixStore()
    store.update("a", [1, 2, 3, 4, 5, 6])
    store.update("b", [9, 3, 4, 7, 7])
    store.update("c", [2, 3, 4, 8])
    found = store.match("q", [0, 2, 3, 4])
    assert found.match_length == 3  # "2 3 4" in a and c; b matches only "3 4"
    assert found.continuations == [[8], [5, 6]]


def test_a_sequence_matches_its_own_earlier_text_but_not_its_end():
    store = SuffixStore()
    tokens = [5, 6, 7, 1, 2, 5, 6]
    store.update("me", tokens)
    found = store.match("me", tokens)
    assert found.match_length == 2 and found.continuations == [[7, 1, 2, 5, 6]]
    store.update("other", [1, 2])
    assert store.match("other", [1, 2]).continuations == [[5, 6]]  # from "me", not its own end


def test_no_match():
    store = SuffixStore()
    store.update("a", [1, 2, 3])
    assert store.match("q", [4, 5, 6]) == SuffixMatch(0, [])
    assert SuffixMatch(0, []).draft_tree(1, 8) == (None, 0.0)


def test_eviction_drops_the_oldest_finished_text_and_keeps_running_requests():
    store = SuffixStore(max_tokens=40)
    store.update("running", [100, 101, 102, 103])
    for i in range(10):
        store.update(f"done{i}", [i, 200, 201, 202, i])
        store.finish(f"done{i}")
    assert store.num_tokens <= 40
    assert store.match("q", [100, 101]).continuations == [[102, 103]]
    assert store.match("q", [0, 200]).match_length == 0  # the oldest finished one went
    assert store.match("q", [9, 200]).continuations == [[201, 202, 9]]


def test_tree_follows_the_candidates_agreement():
    found = SuffixMatch(4, [[1, 2, 3], [1, 2, 4], [1, 5], [6]])
    tree, score = found.draft_tree(root_token=0, budget=8)
    # 1 (3/4), 1-2 (2/4), 2-3 and 2-4 (1/4 each, below MIN_SHARE), 6 and 1-5 (1/4: dropped)
    assert tree.tokens == [0, 1, 2] and tree.parents == [-1, 0, 1]
    assert score == pytest.approx(0.75 + 0.5)


def test_tree_depth_is_bounded_by_the_match_and_the_budget():
    found = SuffixMatch(2, [list(range(10, 30))])
    tree, score = found.draft_tree(0, budget=16)
    assert len(tree) - 1 == suffix.MATCH_FACTOR * 2 and score == 4.0
    assert len(found.draft_tree(0, budget=3)[0]) - 1 == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6), min_size=1, max_size=8),
       st.integers(1, 12))
def test_trees_are_valid_for_the_engine(continuations, budget):
    tree, _ = SuffixMatch(8, continuations).draft_tree(99, budget)
    if tree is None:
        return
    assert len(tree) - 1 <= budget and tree.tokens[0] == 99 and tree.parents[0] == -1
    assert all(0 <= p < i for i, p in enumerate(tree.parents) if i)  # parents come first
    for kids in children_lists(tree.parents):  # siblings are distinct tokens
        assert len({tree.tokens[k] for k in kids}) == len(kids)
    # every root-to-node path is a prefix of some candidate
    for node in range(1, len(tree)):
        path = []
        while node:
            path.append(tree.tokens[node])
            node = tree.parents[node]
        assert any(c[:len(path)] == path[::-1] for c in continuations)


def test_beside_a_draft_only_confident_matches_are_used():
    assert SuffixMatch(6, [[1, 2, 3]]).beats_a_draft(8)
    assert SuffixMatch(suffix.HYBRID_MIN_MATCH, [[1, 2, 3, 4, 5]]).beats_a_draft(8)
    assert not SuffixMatch(suffix.HYBRID_MIN_MATCH - 1, [[1, 2, 3, 4, 5]]).beats_a_draft(8)
    assert not SuffixMatch(6, [[1], [2], [3], [4]]).beats_a_draft(8)  # no agreement
    # Half the candidates agree on one token, then part ways: half a token expected.
    assert not SuffixMatch(6, [[1, 4], [1, 5], [2, 6], [3, 7]]).beats_a_draft(8)


def test_proposer_records_each_request_and_keeps_finished_ones():
    proposer = SuffixProposer()
    proposer.lookup("r1", [1, 2, 3, 4])
    proposer.finish("r1", [1, 2, 3, 4, 5, 6])
    assert proposer.lookup("r2", [7, 3, 4]).continuations == [[5, 6]]


def test_repeated_question_is_drafted_from_the_earlier_reply(tiny_target):
    llm = LLM(tiny_target, speculation="suffix")
    prompt = [random.Random(3).randrange(3, 300) for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = LLM(tiny_target, speculation="off").generate([prompt], params)[0].token_ids
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]
    assert first.token_ids == want and again.token_ids == want
    # The whole reply is in the store: about MATCH_FACTOR x match tokens per step, capped at 8.
    assert again.metrics["acceptance_length"] > 4 > first.metrics["acceptance_length"]
    llm.engine.block_manager.check_no_leak()


def test_suffix_beside_the_draft_uses_the_store_only_where_text_repeats(tiny_target,
                                                                          tiny_draft):
    llm = LLM(tiny_target, tiny_draft, speculation="suffix+chain:2")
    prompt = [random.Random(4).randrange(3, 300) for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]
    assert first.token_ids == again.token_ids
    # chain:2 alone commits at most 3 tokens a step; drafting from the store beats that.
    assert first.metrics["acceptance_length"] <= 3.0 < again.metrics["acceptance_length"]


def test_beside_a_draft_that_does_not_pay_any_match_drafts(tiny_target, tiny_draft):
    """suffix+adaptive: a weak match (its candidates disagree) loses to a draft that is
    drafting, but where adaptive has stopped drafting (its draft does not pay) the store's
    guess costs only its verified rows, so it is used, as `suffix` alone would, unless those
    rows do not pay either; no match runs the fallback's choice."""
    earlier = [[5, 6, 7, 8, 9, 10], [4, 7, 8, 9, 11], [3, 7, 8, 30, 31], [2, 7, 8, 40, 41]]
    weak = SimpleNamespace(request_id="r", all_token_ids=[1, 99, 7, 8], speculation=None)
    alone = SimpleNamespace(request_id="s", all_token_ids=[1, 2, 3], speculation=None)

    def engine_with_store(acceptance: float):
        engine = LLM(tiny_target, tiny_draft, speculation="suffix+adaptive").engine
        for i, tokens in enumerate(earlier):
            engine.suffix.finish(f"earlier{i}", tokens)
        engine.adaptive.engine_acceptance = [acceptance] * MAX_CHAIN  # new requests start here
        return engine

    engine = engine_with_store(0.0)  # nothing accepted: adaptive does not draft
    match = engine.suffix.lookup("r", weak.all_token_ids)
    assert match.match_length >= suffix.HYBRID_MIN_MATCH and not match.beats_a_draft(8)
    assert engine._mode(weak).kind is SpecKind.SUFFIX
    assert not engine._mode(alone).enabled

    # Where a verified row costs a quarter of a step and the store's short matches are
    # rarely followed, they are not worth their rows either: neither drafts.
    for rows in [1, 2, 3, 1, 2, 4] * 4:
        engine.adaptive.observe_step(0.004 + 0.001 * rows, rows, 0.0, 0)
    for _ in range(100):
        engine.adaptive.observe_suffix(match.match_length, 4, 0)
    assert not engine._mode(weak).enabled

    paying = engine_with_store(0.95)
    paying.adaptive.target_time_s, paying.adaptive.draft_level_time_s = 1.0, 0.05
    assert paying._mode(weak).kind is SpecKind.CHAIN
