"""Log-probabilities through the real `openai` package and the WebSocket, checked against
`log_softmax` of the target's logits from a transformers forward pass done here."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from server_helpers import WSConn, done_of, run

pytestmark = pytest.mark.timeout(180)

MESSAGES = [{"role": "user", "content": "Say something."}]
# The engine's kernels batch rows differently from transformers: float32 rounding only.
ATOL = 1e-4


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def hf(tiny_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.engine.tokenizer


def reference_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is the log-distribution of the token after ids[:i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def chat_prompt_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def ids_of(tokens: list[str]) -> list[int]:
    """Token ids from logprob tokens spelled `token_id:ID` (return_tokens_as_token_ids)."""
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_chat_logprobs_match_a_forward_pass(oai, hf, tokenizer):
    reply = oai.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                        max_tokens=16, logprobs=True, top_logprobs=5,
                                        extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 16
    ids = chat_prompt_ids(tokenizer)
    n_prompt = len(ids)
    for entry in content:  # greedy, one reference forward per token
        row = reference_logprobs(hf, ids)[-1]
        token = row.argmax().item()
        ids.append(token)
        assert entry.token == tokenizer.decode([token])
        assert entry.bytes == list(entry.token.encode())
        assert math.isclose(entry.logprob, row[token].item(), abs_tol=ATOL)
        # Greedy: the chosen token is the likeliest one.
        assert entry.logprob == entry.top_logprobs[0].logprob
        assert [t.logprob for t in entry.top_logprobs] == \
            pytest.approx(row.topk(5).values.tolist(), abs=ATOL)
    assert tokenizer.decode(ids[n_prompt:]) == reply.choices[0].message.content


def _completion_logprobs(oai, speculation: str, **extra):
    reply = oai.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=20,
                                   logprobs=3, extra_body={"ignore_eos": True,
                                                           "speculation": speculation,
                                                           "return_tokens_as_token_ids": True},
                                   **extra)
    return reply.choices[0]


def test_completion_logprobs_with_and_without_speculation(oai, hf, tokenizer, server):
    drafts_before = server.core.stats.num_drafts
    spec = _completion_logprobs(oai, "chain:3", temperature=0)
    assert server.core.stats.num_drafts > drafts_before  # it did speculate
    plain = _completion_logprobs(oai, "off", temperature=0)
    assert spec.text == plain.text
    assert spec.logprobs.tokens == plain.logprobs.tokens
    assert spec.logprobs.token_logprobs == pytest.approx(plain.logprobs.token_logprobs,
                                                          abs=ATOL)
    lp = spec.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 20
    texts = [tokenizer.decode([t]) for t in ids_of(lp.tokens)]
    assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(20)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4  # the 3 likeliest, plus the chosen token when it is not one
        assert top[token] == value == max(top.values())  # greedy


def test_sampled_logprobs_are_the_raw_target_distribution(oai, hf, tokenizer):
    """Under sampling (temperature 0.7, top-p 0.9), with and without speculation, every
    committed token's logprob is the unprocessed target's log_softmax at its position."""
    prompt = tokenizer.encode("The quick brown")
    for speculation in ("chain:3", "off"):
        reply = oai.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                       temperature=0.7, top_p=0.9, seed=5, logprobs=2,
                                       extra_body={"ignore_eos": True,
                                                   "speculation": speculation,
                                                   "return_tokens_as_token_ids": True})
        lp = reply.choices[0].logprobs
        ids = ids_of(lp.tokens)
        ref = reference_logprobs(hf, prompt + ids)
        for i, value in enumerate(lp.token_logprobs):
            assert math.isclose(value, ref[len(prompt) - 1 + i, ids[i]].item(), abs_tol=ATOL)
            top2 = ref[len(prompt) - 1 + i].topk(2).values.tolist()
            assert sorted(lp.top_logprobs[i].values(), reverse=True)[:2] == \
                pytest.approx(top2, abs=ATOL)


def test_echo_with_max_tokens_zero_gives_prompt_logprobs(oai, hf, tokenizer):
    # Over the 256-row chunk the LM head runs in, so prompt logprobs come from two chunks.
    prompt = tokenizer.encode("def add(a, b):\n    return a + b\n" * 30)[:300]
    assert len(prompt) == 300
    reply = oai.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True,
                                   logprobs=1)
    choice = reply.choices[0]
    assert choice.text == tokenizer.decode(prompt)
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == 300
    lp = choice.logprobs
    assert len(lp.token_logprobs) == 300
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference_logprobs(hf, prompt)
    expected = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=ATOL)
    for i in range(1, 300):
        assert max(lp.top_logprobs[i].values()) == pytest.approx(ref[i - 1].max().item(),
                                                                 abs=ATOL)


def test_loglikelihood_requests_as_evaluation_harnesses_send_them(oai, hf, tokenizer):
    """lm-evaluation-harness `local-completions`: token-id prompts in one list, echo,
    max_tokens 1, logprobs 1, temperature 0; it sums token_logprobs over the continuation."""
    context = tokenizer.encode("The quick brown")
    continuations = [tokenizer.encode(" fox", add_special_tokens=False),
                     tokenizer.encode(" dog jumps", add_special_tokens=False)]
    prompts = [context + c for c in continuations]
    reply = oai.completions.create(model="tiny", prompt=prompts, max_tokens=1, echo=True,
                                   logprobs=1, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1]
    for choice, ids, cont in zip(reply.choices, prompts, continuations):
        values = choice.logprobs.token_logprobs
        assert len(values) == len(ids) + 1
        ref = reference_logprobs(hf, ids)
        expected = sum(ref[len(context) - 1 + i, t].item() for i, t in enumerate(cont))
        got = sum(values[len(context):len(ids)])
        assert got == pytest.approx(expected, abs=ATOL * len(cont))


def test_n_and_echo_each_choice_gets_the_prompt_logprobs(oai):
    reply = oai.completions.create(model="tiny", prompt="def add(a, b):\n    return a + b\n",
                                   max_tokens=4, n=2, seed=1, echo=True, logprobs=0,
                                   extra_body={"ignore_eos": True})
    a, b = (c.logprobs for c in reply.choices)
    n_prompt = reply.usage.prompt_tokens
    assert len(a.tokens) == len(b.tokens) == n_prompt + 4
    assert a.token_logprobs[:n_prompt] == b.token_logprobs[:n_prompt]
    assert a.token_logprobs[0] is None and None not in a.token_logprobs[1:]


def test_streamed_logprobs_cover_every_token(oai):
    whole = oai.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                        max_tokens=12, logprobs=True, top_logprobs=2,
                                        extra_body={"ignore_eos": True})
    stream = oai.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                         max_tokens=12, logprobs=True, top_logprobs=2,
                                         stream=True, extra_body={"ignore_eos": True})
    streamed = [e for chunk in stream for c in chunk.choices if c.logprobs
                for e in c.logprobs.content]
    expected = whole.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in expected]
    assert [e.logprob for e in streamed] == [e.logprob for e in expected]


def test_websocket_logprobs_are_opt_in(server, hf):
    async def go():
        async with WSConn(server.ws) as conn:
            await conn.create("a", prompt="def add(a, b):", temperature=0,
                              max_output_tokens=10, ignore_eos=True, logprobs=2)
            await conn.create("b", prompt="def add(a, b):", temperature=0,
                              max_output_tokens=10, ignore_eos=True)
            return await conn.until_done("a", "b")

    events = run(go())
    deltas = [e for e in events["a"] if e["type"] == "response.output_text.delta"]
    entries = [lp for e in deltas for lp in e["logprobs"]]
    assert [len(e["logprobs"]) for e in deltas] == [e["n_tokens"] for e in deltas]
    assert done_of(events["a"])["usage"]["output_tokens"] == len(entries) == 10
    prompt = server.engine.tokenizer.encode("def add(a, b):")
    ref = reference_logprobs(hf, prompt + [e["token_id"] for e in entries])
    for i, entry in enumerate(entries):
        row = ref[len(prompt) - 1 + i]
        assert entry["logprob"] == pytest.approx(row[entry["token_id"]].item(), abs=ATOL)
        assert [t["token_id"] for t in entry["top"]] == row.topk(2).indices.tolist()
        assert entry["top"][0]["token_id"] == entry["token_id"]  # greedy
    assert all("logprobs" not in e for e in events["b"])
