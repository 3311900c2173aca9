"""Greedy speculative output equals target-only greedy output, token for token."""

from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams

MODES = ["chain:1", "chain:4", "static:small", [[0], [1], [2], [0, 0], [0, 0, 0]], "tree:12",
         "tree", "ngram:3", "adaptive", "suffix", "suffix:4+chain:3", "suffix+adaptive"]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Repeated phrases give the n-gram proposer something to find.
    return [([rng.randrange(3, 300) for _ in range(rng.randrange(3, 12))] * 3)[:40]
            for _ in range(n)]


def params_for(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=random.Random(i).randrange(5, 40),
                           ignore_eos=True) for i in range(n)]


@pytest.fixture(scope="module")
def expected(tiny_target):
    llm = LLM(tiny_target, speculation="off")
    ps, sp = prompts(8), params_for(8)
    return ps, sp, [o.token_ids for o in llm.generate(ps, sp)]


@pytest.fixture(scope="module")
def spec_llm(tiny_target, tiny_draft):
    return LLM(tiny_target, tiny_draft, num_blocks=160, block_size=8)


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_batch_one(spec_llm, expected, mode):
    ps, sp, want = expected
    for i in (0, 3):
        assert spec_llm.generate([ps[i]], sp[i], speculation=mode)[0].token_ids == want[i]
    spec_llm.engine.block_manager.check_no_leak()


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_eight_mixed_requests(spec_llm, expected, mode):
    ps, sp, want = expected
    outs = spec_llm.generate(ps, sp, speculation=mode)
    assert [o.token_ids for o in outs] == want
    spec_llm.engine.block_manager.check_no_leak()


def test_mixed_modes_with_preemption_and_aborts(tiny_target, tiny_draft, expected):
    ps, sp, want = expected
    llm = LLM(tiny_target, tiny_draft, num_blocks=22, block_size=4, max_num_seqs=8,
              enable_prefix_caching=False)
    engine = llm.engine
    modes = ["chain:3", "tree:8", "static:small", "ngram:2", "off", "tree", "adaptive",
             "suffix:3+chain:2"]
    reqs = [engine.add_request(p, s, speculation=m) for p, s, m in zip(ps, sp, modes)]
    doomed = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                                 speculation="tree") for p in prompts(2, seed=7)]
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps == 4:
            for r in doomed:
                assert engine.abort(r.request_id).finish_reason == "abort"
    assert engine.scheduler.num_preemptions > 0
    assert [r.output_token_ids for r in reqs] == want
    engine.block_manager.check_no_leak()


def test_copy_of_target_accepts_everything(tiny_target):
    llm = LLM(tiny_target, tiny_target)
    for k in (2, 4):
        # 1 token from the prompt forward, then k + 1 per step: 1 + 5 (k + 1) tokens.
        params = SamplingParams(temperature=0, max_tokens=1 + 5 * (k + 1), ignore_eos=True)
        out = llm.generate([[7, 8, 9, 10]], params, speculation=f"chain:{k}")[0]
        assert out.metrics["acceptance_length"] == k + 1
        assert out.metrics["num_accepted_tokens"] == 5 * k
        assert out.metrics["accepted_per_pos"] == [5] * k
        assert out.metrics["acceptance_rate_per_pos"] == [1.0] * k
        assert out.metrics["draft_time_s"] > 0 and out.metrics["target_forward_time_s"] > 0


def test_random_draft_still_exact_and_counts_drafts(spec_llm, expected):
    ps, sp, want = expected
    out = spec_llm.generate([ps[1]], sp[1], speculation="chain:4")[0]
    assert out.token_ids == want[1]
    m = out.metrics
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] >= m["num_drafts"]
    assert 0 <= m["num_accepted_tokens"] <= m["num_draft_tokens"]
    assert 1.0 <= m["acceptance_length"] <= 5.0
    rates = m["acceptance_rate_per_pos"]
    assert len(rates) == 4 and all(0.0 <= r <= 1.0 for r in rates)
    accepted = m["accepted_per_pos"] + [0] * 4
    # Every draft reaches depth 1: the depth-1 rate is accepted-at-1 over all drafts.
    assert rates[0] == accepted[0] / m["num_drafts"]


def test_stop_inside_accepted_run(tiny_target, expected):
    """EOS and max_tokens in the middle of an accepted run: commit up to it, no further."""
    llm = LLM(tiny_target, tiny_target)  # the copy draft accepts whole chains
    ps, _, _ = expected
    full = llm.generate([ps[0]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        speculation="off")[0].token_ids
    out = llm.generate([ps[0]], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                       speculation="chain:4")[0]
    assert out.token_ids == full[:7] and out.finish_reason == "length"
    eos = full[3]
    llm.engine.eos_token_ids = frozenset({eos})
    out = llm.generate([ps[0]], SamplingParams(temperature=0, max_tokens=20),
                       speculation="chain:6")[0]
    assert out.token_ids == full[: full.index(eos) + 1] and out.finish_reason == "stop"
    assert len(out.text) == len(llm.tokenizer.decode(out.token_ids, skip_special_tokens=True))
    llm.engine.block_manager.check_no_leak()
