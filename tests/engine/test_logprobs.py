"""Log-probabilities from the engine: the target's raw log_softmax at every committed token,
under every speculation mode, and at every prompt token across prefill chunks, preemption and
the prefix cache; checked against a transformers forward pass of the target."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.logprobs import chunked_token_logprobs, token_logprobs

ATOL = 1e-4  # float32 rounding: the engine's kernels batch rows differently from transformers


@pytest.fixture(scope="module")
def hf(tiny_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


def reference(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is the log-distribution of the token after ids[:i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def check_output_logprobs(hf, out, num_top: int) -> None:
    ids = out.prompt_token_ids + out.token_ids
    ref = reference(hf, ids)[len(out.prompt_token_ids) - 1:-1]  # rows predicting the outputs
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    want = ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    for lp, row in zip(out.logprobs, ref):
        assert len(lp.top) == num_top
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]),
                                   row.topk(num_top).values, atol=ATOL, rtol=0)


def test_chunked_equals_whole():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 8, generator=gen)  # [k, H]
    head = torch.randn(8, 50, generator=gen)  # [H, V]
    targets = torch.randint(0, 50, (11,), generator=gen).tolist()
    whole = token_logprobs(hidden @ head, targets, 4)
    chunked = chunked_token_logprobs(hidden, targets, 4, lambda h: h @ head, chunk_rows=3)
    assert [lp.token_id for lp in chunked] == targets
    for a, b in zip(whole, chunked):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-6)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert whole[0].logprob == pytest.approx(
        torch.log_softmax(hidden[0] @ head, -1)[targets[0]].item(), abs=1e-6)
    # One call for a whole step: each row with its own request's count.
    counts = [0, 1, 4, 2, 0, 3, 1, 1, 4, 0, 2]
    per_row = token_logprobs(hidden @ head, targets, counts)
    assert [len(lp.top) for lp in per_row] == counts
    assert all(lp.top == w.top[:c] for lp, w, c in zip(per_row, whole, counts))


@pytest.mark.parametrize("speculation", ["off", "chain:4", "tree:12", "ngram:3"])
def test_greedy_output_logprobs_under_speculation(tiny_target, tiny_draft, hf, speculation):
    """A random draft: rejections, bonus and recovered tokens all get scored."""
    llm = LLM(tiny_target, tiny_draft, speculation=speculation, num_blocks=64)
    prompts = [[5, 9, 14, 20, 7], [30, 31, 32] * 4]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, logprobs=3,
                                                ignore_eos=True))
    for out in outs:
        check_output_logprobs(hf, out, 3)
        assert all(lp.top[0][0] == lp.token_id for lp in out.logprobs)  # greedy: the top one
        assert out.prompt_logprobs is None
    if speculation != "off":
        assert sum(o.metrics["num_drafts"] for o in outs) > 0


def test_sampled_logprobs_are_raw(tiny_target, tiny_draft, hf):
    """Temperature and top-p shape sampling, not the reported values."""
    llm = LLM(tiny_target, tiny_draft, speculation="tree:8", num_blocks=64)
    outs = llm.generate([[5, 9, 14], [40, 41]], [
        SamplingParams(temperature=0.6, top_p=0.8, seed=3, max_tokens=20, logprobs=2,
                       ignore_eos=True),
        SamplingParams(temperature=1.5, top_k=5, seed=4, max_tokens=20, logprobs=0,
                       ignore_eos=True)])
    check_output_logprobs(hf, outs[0], 2)
    check_output_logprobs(hf, outs[1], 0)


def test_prompt_logprobs_across_chunks_preemption_and_prefix_cache(tiny_target, hf):
    prompt = torch.randint(3, 300, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    ref = reference(hf, prompt)
    want = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    # 40-token prefill chunks, and a pool so small that requests preempt one another.
    llm = LLM(tiny_target, speculation="off", num_blocks=24, block_size=8,
              max_num_batched_tokens=40)
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))[0]
    params = SamplingParams(temperature=0, max_tokens=30, prompt_logprobs=2, ignore_eos=True)
    outs = llm.generate([prompt, prompt[:90], prompt], [params, params, SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True)])
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    for out in outs[:2]:
        n = len(out.prompt_token_ids)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
        assert [lp.token_id for lp in out.prompt_logprobs[1:]] == out.prompt_token_ids[1:]
        got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
        torch.testing.assert_close(got, want[:n - 1], atol=ATOL, rtol=0)
        for lp, row in zip(out.prompt_logprobs[1:], ref):
            assert [t for t, _ in lp.top] == row.topk(2).indices.tolist()
        assert out.logprobs is None
    # The prompt was cached by the first run; scoring it needs its hidden states, so the
    # requests asking for prompt logprobs computed it again, and the plain one did not.
    assert plain.metrics["num_prefix_cached_tokens"] == 0
    assert outs[0].metrics["num_prefix_cached_tokens"] == 0
    assert outs[1].metrics["num_prefix_cached_tokens"] == 0
    assert outs[2].metrics["num_prefix_cached_tokens"] > 0
