"""The OpenAI-compatible routes, driven by the real `openai` package; /metrics and /health."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from specserve import SamplingParams

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0,
                         timeout=30)


def _chat_reference(reference, max_tokens: int):
    tok = reference.tokenizer
    ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)
    return reference.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    ignore_eos=True))[0]


def test_models_lists_the_served_model(oai, server):
    models = oai.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].root == str(server.core.config.target)


def test_streaming_chat_completion_with_usage(oai, reference):
    stream = oai.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=20, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    expected = _chat_reference(reference, 20)
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(c.choices[0].delta.content for c in content) == expected.text
    # The role rides on the first real token and only there.
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0] is content[0]
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_streaming_without_usage_ends_with_done(server):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "stream": True}
    with httpx.Client(timeout=30) as client:
        r = client.post(f"{server.http}/v1/chat/completions", json=body)
    events = [line for line in r.text.split("\n\n") if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert '"usage"' not in r.text


def test_non_streaming_chat_completion(oai, reference):
    reply = oai.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                        max_tokens=16, extra_body={"ignore_eos": True})
    expected = _chat_reference(reference, 16)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
        len(expected.prompt_token_ids), 16)
    assert reply.model_extra["metrics"]["acceptance_length"] > 1.0


def test_completions_streaming_and_not(oai, reference):
    expected = reference.generate("def add(a, b):", SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))[0]
    whole = oai.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=12,
                                   temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected.text
    assert whole.usage.completion_tokens == 12
    streamed = oai.completions.create(model="tiny", prompt=["def add(a, b):"], max_tokens=12,
                                      temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    ids = oai.completions.create(model="tiny", prompt=expected.prompt_token_ids, max_tokens=12,
                                 temperature=0, extra_body={"ignore_eos": True})
    assert ids.choices[0].text == expected.text


def test_errors_are_openai_shaped(oai, server):
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", messages=MESSAGES, top_p=7)
    assert (info.value.body["code"], info.value.body["param"]) == ("invalid_field", "top_p")
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10**6)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", messages=MESSAGES,
                                    n=server.app.state.server.limits.max_choices + 1)
    assert info.value.body["param"] == "n"
    r = httpx.post(f"{server.http}/v1/completions", content=b"{oops", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_client_disconnect_mid_stream_cancels_the_request(server):
    finished_before = server.core.stats.num_finished
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 450, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as client, \
            client.stream("POST", f"{server.http}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    deadline = time.monotonic() + 10
    while server.engine.num_in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)
    server.wait_idle()
    assert server.core.stats.num_finished == finished_before  # aborted, not run to the end


def test_metrics_use_vllm_spec_decode_names(oai, server):
    oai.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=0,
                           extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.http}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    stats = server.core.stats
    label = '{model_name="tiny"}'
    assert values[f"vllm:spec_decode_num_drafts_total{label}"] == stats.num_drafts > 0
    assert values[f"vllm:spec_decode_num_draft_tokens_total{label}"] == stats.num_draft_tokens
    assert values[f"vllm:spec_decode_num_accepted_tokens_total{label}"] == \
        stats.num_accepted_tokens > 0
    assert values['vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",'
                  'position="0"}'] == stats.accepted_per_pos[0]
    assert values[f"specserve_kv_blocks_total{label}"] == server.core.block_manager.num_blocks
    assert values['specserve_requests_total{api="openai",status="length"}'] >= 1
    assert any(k.startswith("specserve_time_to_first_token_seconds_bucket") for k in values)


def test_health(server):
    r = httpx.get(f"{server.http}/health", timeout=10)
    assert r.status_code == 200
    assert r.json()["status"] == "ok" and r.json()["auth_required"] is False
