"""Tensor parallelism end to end on CPU: gloo, rank 0 here and one spawned worker.

Greedy output at tp=2 equals tp=1 token for token (with and without speculation, chain and tree,
a draft kept whole on rank 0 or split like the target); a killed worker fails the engine within
seconds with an error naming it; shutdown leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from specserve import LLM, SamplingParams
from specserve.distributed import TensorParallelError, collective_stats
from tests.tiny_models import save_model

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PROMPTS = ["def add(a, b):", "The quick brown fox", "héllo wörld ✓ " * 12]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
MODES = ["off", "chain:3", "tree:8", [[0], [1], [0, 0], [0, 1], [1, 0]], "adaptive"]


def _greedy(llm: LLM, mode) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(PROMPTS, GREEDY, speculation=mode)]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def one_kv_tied(model_dir):
    """Qwen2 (q/k/v biases), 1 KV head replicated over both ranks, tied LM head."""
    return save_model(model_dir / "tp_one_kv_tied", "qwen2", seed=2, num_key_value_heads=1,
                      tie_word_embeddings=True)


def test_tp2_matches_tp1_draft_on_rank0(tiny_target, tiny_draft):
    """4 query / 2 KV heads, untied head; the draft whole on rank 0."""
    expected = {str(m): _greedy(LLM(tiny_target, tiny_draft), m) for m in MODES}
    llm = LLM(tiny_target, tiny_draft, tp=2)
    try:
        pids = llm.tensor_parallel.worker_pids
        assert len(pids) == 1
        # Rank 0's paged KV holds its own KV head only: [L, 2, blocks, block_size, Hkv, D].
        assert llm.engine.runner.kv_cache.shape[4] == 1
        assert llm.engine.proposer.runner.kv_cache.shape[4] == 2  # the whole draft
        reduces = collective_stats().all_reduce_count
        for mode in MODES:
            assert _greedy(llm, mode) == expected[str(mode)], mode
        # Two row-parallel all-reduces per layer and one for the embedding, per target forward.
        assert collective_stats().all_reduce_count - reduces >= 5 * len(MODES)
    finally:
        llm.shutdown()
    for pid in pids:
        assert _gone(pid)


def test_tp2_matches_tp1_draft_split(one_kv_tied, tiny_draft):
    """1 KV head (replicated), tied head with q/k/v biases; the draft split too (draft_tp=2)."""
    expected = {str(m): _greedy(LLM(one_kv_tied, tiny_draft), m) for m in MODES[:3]}
    llm = LLM(one_kv_tied, tiny_draft, tp=2, draft_tp=2)
    try:
        assert llm.engine.draft.shard.world_size == 2
        assert llm.engine.draft.layers[0].self_attn.num_heads == 2
        assert llm.engine.target.layers[0].self_attn.num_kv_heads == 1
        for mode in MODES[:3]:
            assert _greedy(llm, mode) == expected[str(mode)], mode
    finally:
        llm.shutdown()


def test_killed_worker_fails_fast(tiny_target):
    llm = LLM(tiny_target, tp=2)
    failures = []
    llm.tensor_parallel.on_failure(failures.append)
    try:
        assert len(_greedy(llm, "off")[0]) == GREEDY.max_tokens
        (pid,) = llm.tensor_parallel.worker_pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1"):
            while time.monotonic() - start < 10:  # before the watcher notices, a step may pass
                _greedy(llm, "off")
        assert time.monotonic() - start < 10
        deadline = time.monotonic() + 5
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failures and "worker rank 1" in failures[0] and "exited with code -9" in failures[0]
        with pytest.raises(TensorParallelError, match="rank 1"):  # and stays failed
            _greedy(llm, "off")
    finally:
        llm.shutdown()
    assert _gone(pid)


def test_bad_tp_options_are_clear_errors(tiny_target, tiny_draft):
    with pytest.raises(ValueError, match="tp must be a positive int"):
        LLM(tiny_target, tp=0)
    with pytest.raises(ValueError, match="draft_tp must be 1 .* or tp=2; got 3"):
        LLM(tiny_target, tiny_draft, tp=2, draft_tp=3)


def _assert_logprobs_close(got, want) -> None:
    assert (got is None) == (want is None)
    for g, w in zip(got or [], want or [], strict=True):
        assert (g is None) == (w is None)
        if w is None:
            continue
        assert g.token_id == w.token_id and abs(g.logprob - w.logprob) < 1e-3
        assert [t for t, _ in g.top] == [t for t, _ in w.top]


def test_tp2_quantized_with_prompt_logprobs_matches_tp1(tiny_target, tiny_draft):
    """int8 weights split on whole blocks, and prompt logprobs through the vocab-parallel head
    (ModelRunner.logits broadcast to the worker): the same tokens and log-probabilities."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2,
                            prompt_logprobs=2)
    expected = LLM(tiny_target, tiny_draft, quantization="int8").generate(
        PROMPTS, params, speculation="chain:3")
    llm = LLM(tiny_target, tiny_draft, tp=2, quantization="int8")
    try:
        got = llm.generate(PROMPTS, params, speculation="chain:3")
        for g, w in zip(got, expected, strict=True):
            assert g.token_ids == w.token_ids
            assert len(w.prompt_logprobs) == len(w.prompt_token_ids)
            _assert_logprobs_close(g.prompt_logprobs, w.prompt_logprobs)
            _assert_logprobs_close(g.logprobs, w.logprobs)
    finally:
        llm.shutdown()
