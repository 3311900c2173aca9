"""The OpenAI API as clients use it, through the real `openai` package: n, prompt lists, echo,
best_of, models.retrieve, nulls, JSON 404/405, /tokenize and /detokenize, refused features."""

from __future__ import annotations

import httpx
import openai
import pytest

from specserve import SamplingParams

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "Say something."}]
# Over one 16-token KV block, so samples of it can share the prompt's first block.
LONG_PROMPT = "def add(a, b):\n    return a + b\n" * 2


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0,
                         timeout=30)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.http}{path}", json=body, timeout=30)


def test_models_retrieve(oai, server):
    model = oai.models.retrieve("tiny")
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "specserve")
    assert oai.models.retrieve(str(server.core.config.target)).id == "tiny"
    with pytest.raises(openai.NotFoundError) as info:
        oai.models.retrieve("gpt-9")
    assert (info.value.body["code"], info.value.body["param"]) == ("model_not_found", "model")


def test_unknown_route_and_wrong_method_are_openai_json(server):
    r = httpx.get(f"{server.http}/v1/embeddings", timeout=10)
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "not_found"
    assert "/v1/embeddings" in r.json()["error"]["message"]
    r = httpx.get(f"{server.http}/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in r.headers["allow"]


def test_explicit_nulls_are_accepted(server, reference):
    nulls = dict.fromkeys(["temperature", "top_p", "stop", "seed", "n", "stream",
                           "stream_options", "presence_penalty", "frequency_penalty",
                           "logit_bias", "top_k", "ignore_eos", "speculation"])
    body = {"model": "tiny", "max_tokens": 6, **nulls}
    r = _post(server, "/v1/completions", {**body, "prompt": "abc", "echo": None,
                                          "logprobs": None, "best_of": None, "suffix": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    r = _post(server, "/v1/chat/completions", {
        **body, "messages": MESSAGES, "max_tokens": None, "max_completion_tokens": None,
        "logprobs": None, "top_logprobs": None, "tools": None, "tool_choice": None,
        "response_format": None, "structured_outputs": None, "guided_json": None,
        "guided_regex": None, "guided_grammar": None, "guided_choice": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def test_n_samples_are_seeded_reproducible_and_share_the_prompt(oai, reference):
    args = dict(model="tiny", prompt=LONG_PROMPT, max_tokens=12, temperature=1.0, n=3,  # noqa: C408
                seed=7, extra_body={"ignore_eos": True})
    first = oai.completions.create(**args)
    again = oai.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1  # each sample has its own random stream
    # Sample j samples with seed + j: what the offline API gives for that seed.
    for j, text in enumerate(texts):
        expected = reference.generate(LONG_PROMPT, SamplingParams(
            temperature=1.0, max_tokens=12, seed=7 + j, ignore_eos=True))[0]
        assert text == expected.text
    assert first.usage.completion_tokens == 36
    assert first.usage.prompt_tokens == len(expected.prompt_token_ids)
    # Samples after the first found the prompt's full blocks in the prefix cache.
    cached = [c.model_extra["metrics"]["num_prefix_cached_tokens"] for c in first.choices]
    assert cached[1] >= 16 and cached[2] >= 16


def test_n_in_chat_streaming(oai):
    stream = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, n=2,
                                         seed=3, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = {0: "", 1: ""}
    finish = {}
    for chunk in chunks:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 16
    whole = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, n=2,
                                        seed=3, extra_body={"ignore_eos": True})
    assert [c.message.content for c in whole.choices] == [text[0], text[1]]


def test_disconnect_cancels_every_sample(server):
    finished_before = server.core.stats.num_finished
    body = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 400, "n": 3, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as client, \
            client.stream("POST", f"{server.http}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    server.wait_idle()  # every sample's blocks are back (also those of unstarted ones)
    assert server.core.stats.num_finished == finished_before


def test_prompt_list_each_its_own_choice(oai, reference):
    prompts = ["def add(a, b):", "The quick brown", "héllo"]
    expected = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=6,
                                                          ignore_eos=True))
    reply = oai.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [e.text for e in expected]
    assert reply.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    # Token-id prompts in a list (what lm-evaluation-harness sends), combined with n:
    # choice i * n + j is sample j of prompt i.
    ids = [e.prompt_token_ids for e in expected[:2]]
    reply = oai.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, n=2,
                                   extra_body={"ignore_eos": True})
    assert [c.text for c in reply.choices] == [expected[0].text] * 2 + [expected[1].text] * 2
    streamed = oai.completions.create(model="tiny", prompt=prompts, max_tokens=6,
                                      temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
    text = ["", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            text[choice.index] += choice.text
    assert text == [e.text for e in expected]


def test_echo_repeats_the_prompt(oai, reference):
    expected = reference.generate("def add(a, b):", SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True))[0]
    reply = oai.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=5,
                                   temperature=0, echo=True, extra_body={"ignore_eos": True})
    assert reply.choices[0].text == "def add(a, b):" + expected.text
    only = oai.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=0,
                                  echo=True)
    assert only.choices[0].text == "def add(a, b):"
    assert only.usage.completion_tokens == 0
    streamed = oai.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=5,
                                      temperature=0, echo=True, stream=True,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == \
        "def add(a, b):" + expected.text


def test_best_of_keeps_the_likeliest(oai):
    reply = oai.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=1.0,
                                   n=2, best_of=4, seed=11, logprobs=0,
                                   extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1]
    scores = [sum(c.logprobs.token_logprobs) for c in reply.choices]
    assert scores[0] >= scores[1]
    assert reply.usage.completion_tokens == 24  # every sample drawn counts
    # The kept two are the best two of the four the same seeds give with n=4.
    four = oai.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=1.0,
                                  n=4, seed=11, logprobs=0, extra_body={"ignore_eos": True})
    best = sorted(four.choices, key=lambda c: -sum(c.logprobs.token_logprobs))[:2]
    assert [c.text for c in reply.choices] == [c.text for c in best]


def test_tokenize_and_detokenize(server, oai, reference):
    tok = reference.tokenizer
    r = _post(server, "/tokenize", {"model": "tiny", "prompt": "def add(a, b):",
                                    "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("def add(a, b):")
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.app.state.server.limits.max_model_len
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    # Messages tokenize exactly as the chat route counts them.
    r = _post(server, "/tokenize", {"messages": MESSAGES})
    reply = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert r.json()["count"] == reply.usage.prompt_tokens
    assert r.json()["token_strs"] is None
    r = _post(server, "/detokenize", {"model": "tiny", "tokens": body["tokens"]})
    assert r.json() == {"prompt": "def add(a, b):"}
    r = _post(server, "/detokenize", {"tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = _post(server, "/tokenize", {"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = _post(server, "/tokenize", {"prompt": "x", "messages": MESSAGES})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    info = httpx.get(f"{server.http}/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template


def _refused(call, param: str, code: str = "invalid_field") -> None:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert (info.value.body["param"], info.value.body["code"]) == (param, code), \
        info.value.body


def test_bad_input_names_the_field(oai, server):
    chat, comp = oai.chat.completions.create, oai.completions.create
    _refused(lambda: comp(model="tiny", prompt="a", logprobs=21), "logprobs")
    _refused(lambda: chat(model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=21),
             "top_logprobs")
    _refused(lambda: chat(model="tiny", messages=MESSAGES, top_logprobs=2), "top_logprobs")
    limit = server.app.state.server.limits.max_choices
    _refused(lambda: comp(model="tiny", prompt="a", n=limit + 1), "n")
    _refused(lambda: comp(model="tiny", prompt=["a", "b"], n=limit // 2 + 1), "n")
    _refused(lambda: comp(model="tiny", prompt=[]), "prompt")
    _refused(lambda: comp(model="tiny", prompt=["a", ""]), "prompt")
    _refused(lambda: comp(model="tiny", prompt="a", max_tokens=0), "max_tokens")
    _refused(lambda: chat(model="tiny", messages=MESSAGES, max_tokens=0), "max_tokens")
    _refused(lambda: comp(model="tiny", prompt="a", n=3, best_of=2), "best_of")
    _refused(lambda: comp(model="tiny", prompt="a", best_of=2, stream=True), "best_of")


def test_unsupported_features_are_refused_not_ignored(oai):
    chat = oai.chat.completions.create
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    # Tools and structured output are served (tests/structured); what they cannot do is named.
    _refused(lambda: chat(model="tiny", messages=MESSAGES, tool_choice="required"),
             "tool_choice", "invalid_field")
    _refused(lambda: chat(model="tiny", messages=MESSAGES, response_format={"type": "xml"}),
             "response_format.type", "unsupported_field")
    _refused(lambda: chat(model="tiny", messages=MESSAGES, presence_penalty=0.5),
             "presence_penalty", "unsupported_field")
    _refused(lambda: oai.completions.create(model="tiny", prompt="a", logit_bias={"5": 3}),
             "logit_bias", "unsupported_field")
    _refused(lambda: oai.completions.create(model="tiny", prompt="a", suffix="z"), "suffix",
             "unsupported_field")
    # What does nothing is fine: tools the model is told not to call, plain text format.
    reply = chat(model="tiny", messages=MESSAGES, max_tokens=2, tools=tools, tool_choice="none",
                 response_format={"type": "text"}, presence_penalty=0)
    assert reply.choices[0].message.content is not None
