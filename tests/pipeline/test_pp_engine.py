"""Pipeline parallelism end to end on CPU: gloo, rank 0 here and spawned workers.

Greedy output at pp=2 equals pp=1 token for token, without and with speculation (chain, tree,
static, adaptive), with eight requests batched through a pool small enough to preempt, so the
batch queue keeps two micro-batches in flight; pp=2 x tp=2 on four processes does too. A
killed stage fails the engine within seconds with an error naming its stage and rank, and
shutdown leaves no process behind. Where its wheel is installed, the default model (GGUF) with
its EAGLE-style draft gives the same tokens at pp=2.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from specserve import LLM, SamplingParams
from specserve.distributed import TensorParallelError, collective_stats
from tests.test_default_model import wheel_installed

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PROMPTS = ["def add(a, b):", "The quick brown fox", "héllo wörld ✓ " * 12, "1 2 3 4 5",
           "abc abc abc", "x = [", "Once upon", "import os\n"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
LOGPROBS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2,
                         prompt_logprobs=2)
MODES = ["off", "chain:3", "tree:8", [[0], [1], [0, 0], [0, 1], [1, 0]], "adaptive"]
# 40 blocks of 4 tokens for 8 requests of up to ~190 tokens: preemption under every mode.
SMALL_POOL = {"num_blocks": 40, "block_size": 4, "max_num_seqs": 8,
              "enable_prefix_caching": False}


def _greedy(llm: LLM, mode, prompts=PROMPTS) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, GREEDY, speculation=mode)]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_pp2_matches_pp1_batched_with_preemption(tiny_target, tiny_draft):
    base = LLM(tiny_target, tiny_draft, **SMALL_POOL)
    expected = {str(m): _greedy(base, m) for m in MODES}
    assert base.engine.scheduler.num_preemptions > 0
    llm = LLM(tiny_target, tiny_draft, pp=2, **SMALL_POOL)
    try:
        pids = llm.tensor_parallel.worker_pids
        assert len(pids) == 1
        # Rank 0 holds stage 0: one of the two layers, and its KV only.
        assert llm.engine.runner.kv_cache.shape[0] == 1
        assert llm.engine.target.lm_head is None
        sent = collective_stats().send_bytes
        for mode in MODES:
            assert _greedy(llm, mode) == expected[str(mode)], mode
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0
        assert engine.max_in_flight == 2  # the batch queue overlapped micro-batches
        assert collective_stats().send_bytes > sent  # hidden states went down the link
        engine.block_manager.check_no_leak()
        # At batch 1 one micro-batch at a time, and the same tokens.
        assert _greedy(llm, "chain:3", PROMPTS[:1]) == expected["chain:3"][:1]
        # Log-probabilities: the prompt's hidden rows come back from the last stage and go to
        # it again through the LM head (ModelRunner.logits), behind the forwards in flight.
        for got, want in zip(llm.generate(PROMPTS[:3], LOGPROBS, speculation="chain:3"),
                             base.generate(PROMPTS[:3], LOGPROBS, speculation="chain:3"),
                             strict=True):
            assert got.token_ids == want.token_ids
            assert len(got.prompt_logprobs) == len(got.prompt_token_ids)
            for g, w in zip(got.prompt_logprobs + got.logprobs,
                            want.prompt_logprobs + want.logprobs, strict=True):
                assert (g is None) == (w is None)
                if w is not None:
                    assert g.token_id == w.token_id and abs(g.logprob - w.logprob) < 1e-4
                    assert [t for t, _ in g.top] == [t for t, _ in w.top]
    finally:
        llm.shutdown()
    for pid in pids:
        assert _gone(pid)


def test_pp2_tp2_four_processes(tiny_target, tiny_draft):
    """Stage 0 = ranks 0, 1 and stage 1 = ranks 2, 3; each stage's all-reduces in its own
    group, the draft split over stage 0's two ranks (draft_tp=2)."""
    modes = MODES[:3]
    expected = {str(m): _greedy(LLM(tiny_target, tiny_draft), m, PROMPTS[:4]) for m in modes}
    llm = LLM(tiny_target, tiny_draft, pp=2, tp=2, draft_tp=2)
    try:
        pids = llm.tensor_parallel.worker_pids
        assert len(pids) == 3
        kv = llm.engine.runner.kv_cache  # [L, 2, blocks, block_size, Hkv, D]
        assert kv.shape[0] == 1 and kv.shape[4] == 1  # one layer, one of two KV heads
        assert llm.engine.draft.shard.world_size == 2
        for mode in modes:
            assert _greedy(llm, mode, PROMPTS[:4]) == expected[str(mode)], mode
    finally:
        llm.shutdown()
    for pid in pids:
        assert _gone(pid)


def test_killed_stage_fails_fast(tiny_target):
    llm = LLM(tiny_target, pp=2)
    failures = []
    llm.tensor_parallel.on_failure(failures.append)
    try:
        assert len(_greedy(llm, "off")[0]) == GREEDY.max_tokens
        (pid,) = llm.tensor_parallel.worker_pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="stage 1"):
            while time.monotonic() - start < 10:  # before the watcher notices, a step may pass
                _greedy(llm, "off")
        assert time.monotonic() - start < 10
        deadline = time.monotonic() + 5
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failures and "pipeline stage 1 (tp rank 0) worker rank 1" in failures[0]
        assert "exited with code -9" in failures[0]
        with pytest.raises(TensorParallelError, match="stage 1"):  # and stays failed
            _greedy(llm, "off")
    finally:
        llm.shutdown()
    assert _gone(pid)


def test_bad_pp_option_is_a_clear_error(tiny_target):
    """(More stages than layers fails in every rank's load: test_pp_stages.test_layer_ranges.)"""
    with pytest.raises(ValueError, match="pp must be a positive int"):
        LLM(tiny_target, pp=0)


@pytest.mark.skipif(not wheel_installed(), reason="the default model's wheel is not installed")
def test_default_model_and_its_draft_at_pp2():
    """The real default model: a GGUF file (each stage dequantizes its own tensors, Q4_1
    projections on the file's blocks) and its EAGLE-style draft on rank 0, which shares stage
    0's embedding and reads the target's hidden states back from the last stage."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    conversations = [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "user", "content": "Write a haiku about the sea."}]]
    want = [out.token_ids for out in LLM().chat(conversations, params)]
    llm = LLM(pp=2)
    try:
        assert llm.engine.proposer.reads_target_hidden
        assert [out.token_ids for out in llm.chat(conversations, params)] == want
    finally:
        llm.shutdown()
