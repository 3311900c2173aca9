"""Continuous batching: batched == alone, preemption, prefix caching, aborts, stop handling."""

from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams
from specserve.engine.detokenizer import IncrementalDetokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_target):
    return LLM(tiny_target, max_num_batched_tokens=64, max_num_seqs=8, num_blocks=128)


@pytest.fixture(scope="module")
def alone(tiny_target):
    """Reference outputs: each prompt run by itself on a fresh engine."""
    llm = LLM(tiny_target, enable_prefix_caching=False)
    prompts = mixed_prompts(16)
    params = [SamplingParams(temperature=0.0, max_tokens=random.Random(i).randrange(1, 30),
                             ignore_eos=True) for i in range(16)]
    return prompts, params, [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]


def test_sixteen_mixed_requests_batched_equal_alone(llm, alone):
    prompts, params, expected = alone
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    llm.engine.block_manager.check_no_leak()


def test_preemption_keeps_outputs(tiny_target, alone):
    prompts, params, expected = alone
    small = LLM(tiny_target, num_blocks=26, block_size=4, max_num_seqs=8,
                enable_prefix_caching=False)
    outs = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    small.engine.block_manager.check_no_leak()


def test_prefix_cache_reuses_shared_prefix(tiny_target):
    llm = LLM(tiny_target, block_size=4)
    system = mixed_prompts(1, seed=5)[0] + mixed_prompts(1, seed=6)[0]  # long shared prefix
    first = llm.generate([system + [10, 11, 12]], GREEDY)[0]
    computed_before = llm.engine.stats.num_prompt_tokens
    second = llm.generate([system + [10, 11, 12]], GREEDY)[0]
    computed = llm.engine.stats.num_prompt_tokens - computed_before
    assert second.token_ids == first.token_ids
    assert second.metrics["num_prefix_cached_tokens"] >= len(system) - 4
    assert computed <= len(system) + 3 - second.metrics["num_prefix_cached_tokens"]
    assert computed < len(system) // 2
    assert llm.engine.block_manager.prefix_hits > 0
    fresh = LLM(tiny_target, block_size=4, enable_prefix_caching=False)
    assert fresh.generate([system + [10, 11, 12]], GREEDY)[0].token_ids == first.token_ids
    llm.engine.block_manager.check_no_leak()


def test_abort_mid_generation_frees_blocks(llm):
    engine = llm.engine
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
            for p in mixed_prompts(4, seed=9)]
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    delta = engine.abort(reqs[0].request_id)
    assert delta.finish_reason == "abort"
    assert engine.abort(reqs[0].request_id) is None  # safe to repeat
    for r in reqs[1:]:
        engine.abort(r.request_id)
    assert not engine.has_work
    engine.block_manager.check_no_leak()


def test_max_tokens_and_eos(tiny_target):
    llm = LLM(tiny_target)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=7,
                                                   ignore_eos=True))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    # Make the model's own greedy token the EOS: generation stops right there.
    first = out.token_ids[0]
    llm.engine.eos_token_ids = frozenset({first})
    stopped = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=7))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"


def test_stop_string_split_across_tokens(tiny_target):
    llm = LLM(tiny_target)
    full = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=30,
                                                    ignore_eos=True))[0]
    text = full.text
    # A stop string that straddles a token boundary somewhere in the middle of the output.
    tok = llm.tokenizer
    pieces = [tok.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    cut = next(i for i in range(4, len(pieces)) if len(pieces[i]) - len(pieces[i - 1]) >= 1
               and len(pieces[i - 1]) >= 2)
    stop = text[len(pieces[cut - 1]) - 1: len(pieces[cut - 1]) + 1]
    assert len(stop) == 2
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=30,
                                                   ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)


class ByteTokenizer:
    """Decodes ids as raw bytes, like a byte-level BPE splitting a character over tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_never_emits_a_broken_character():
    text = "héllo ✓ 你好 🙂!"
    detok = IncrementalDetokenizer(ByteTokenizer(), list(b"ok "))
    pieces = [detok.push(b) for b in text.encode()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_an_incomplete_last_character_is_flushed_at_the_end():
    """Output that stops inside a character: streaming held its bytes back, and the end gives
    them as the full decode does (U+FFFD), so streamed text equals the final text."""
    detok = IncrementalDetokenizer(ByteTokenizer(), list(b"ok "))
    pieces = [detok.push(b) for b in "a✓".encode()[:-1]]  # "a", then 2 of ✓'s 3 bytes
    assert "".join(pieces) == "a"
    assert detok.flush() == bytes("✓".encode()[:-1]).decode("utf-8", errors="replace")
    assert detok.flush() == ""


def test_an_aborted_request_ends_its_text_as_its_tokens_decode(tiny_target):
    """A stop from the client can land inside a character too: the abort's delta carries the
    held-back bytes, so the streamed text is what the same tokens decode to (what a request
    for exactly that many tokens returns)."""
    llm = LLM(tiny_target)
    tok = llm.tokenizer
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=40, ignore_eos=True)
    full = llm.generate([tok.encode("你好 🙂 héllo")], params)[0].token_ids
    ends_inside = [n for n in range(1, len(full))  # the last: done before the abort
                   if tok.decode(full[:n], skip_special_tokens=True).endswith("\ufffd")]
    assert ends_inside  # seed 3's reply has a character split over tokens
    n = ends_inside[-1]
    req = llm.engine.add_request(tok.encode("你好 🙂 héllo"), params)
    streamed = []
    while len(req.output_token_ids) < n:
        streamed += [d.text for d in llm.engine.step() if d.request_id == req.request_id]
    assert req.output_token_ids == full[:n]
    streamed.append(llm.engine.abort(req.request_id).text)
    assert "".join(streamed) == tok.decode(full[:n], skip_special_tokens=True)


def test_streamed_text_equals_final_text_with_multibyte(tiny_target):
    llm = LLM(tiny_target)
    tok = llm.tokenizer
    prompt = tok.encode("你好 🙂 héllo")
    req = llm.engine.add_request(prompt, SamplingParams(temperature=0.9, seed=3, max_tokens=40,
                                                        ignore_eos=True))
    streamed = []
    while not req.is_finished:
        streamed += [d.text for d in llm.engine.step() if d.request_id == req.request_id]
    # A random model emits byte sequences that are invalid UTF-8 anywhere; what matters is
    # that streaming adds no replacement character the full decode does not have.
    assert "".join(streamed) == req.output_text == tok.decode(req.output_token_ids,
                                                               skip_special_tokens=True)


def test_seeded_sampling_independent_of_batch(tiny_target):
    llm = LLM(tiny_target)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)
    solo = llm.generate([[4, 5, 6]], params)[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(5)]
    batched = llm.generate([[4, 5, 6]] + mixed_prompts(5, seed=2), [params] + others)
    assert batched[0].token_ids == solo


def test_bad_requests_are_clear_errors(llm):
    with pytest.raises(ValueError, match="exceeds the model's context"):
        llm.generate([[1] * 500], SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="token ids must be ints"):
        llm.generate([[1, 10_000]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    llm.engine.block_manager.check_no_leak()



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_budget_counts_a_models_cache_in_its_own_dtype(tiny_target, dtype):
    """The engine sizes its block pool from kv_bytes_per_block of each model (a bfloat16 draft
    beside a float32 target): it must be what the model's runner holds per block."""
    from specserve.model.loader import load_model
    from specserve.model.runner import ModelRunner, kv_bytes_per_block

    model = load_model(tiny_target, dtype=dtype)
    runner = ModelRunner(model, num_blocks=2, block_size=16)
    assert kv_bytes_per_block(model, 16) == runner.kv_cache[:, :, 0].nbytes


def test_a_draft_of_another_vocabulary_is_refused_naming_both(tiny_target):
    from specserve.named_models import demo_pair

    _, demo_draft = demo_pair()
    with pytest.raises(ValueError, match=r"\(\d+ tokens\) and target .*\(\d+ tokens\) have "
                                         r"different vocabularies \(id \d+: target '.*', draft"):
        LLM(tiny_target, demo_draft)
