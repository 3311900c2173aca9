"""Structured output and tool calling through the OpenAI routes, driven by the `openai` SDK
against a real uvicorn serving the demo pair (a real tokenizer, a trained draft)."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest

from specserve.named_models import demo_pair
from tests.server.server_helpers import WSConn, run, start_server, text_of

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "population": {"type": "integer"},
                         "coastal": {"type": "boolean"}},
          "required": ["city", "population", "coastal"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object",
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"]}}}
ASK = [{"role": "user", "content": "Tell me about a city."}]


@pytest.fixture(scope="module")
def server():
    target, draft = demo_pair()
    srv = start_server(target, draft, "tree")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(autouse=True)
def _idle(server):
    yield
    server.wait_idle(30)


def chat(oai, **kwargs):
    kwargs.setdefault("max_tokens", 80)
    kwargs.setdefault("temperature", 0)
    return oai.chat.completions.create(model="tiny", messages=kwargs.pop("messages", ASK),
                                       **kwargs)


@pytest.mark.slow
def test_json_schema_validates_and_is_the_same_in_every_mode(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    texts = {}
    for mode in ("off", "chain:4", "tree"):
        out = chat(oai, response_format=fmt, extra_body={"speculation": mode})
        assert out.choices[0].finish_reason == "stop"
        texts[mode] = out.choices[0].message.content
        value = json.loads(texts[mode])
        assert list(value) == ["city", "population", "coastal"]
        assert isinstance(value["city"], str) and len(value["city"]) <= 12
        assert type(value["population"]) is int and type(value["coastal"]) is bool
    assert texts["chain:4"] == texts["off"] == texts["tree"]


def test_json_object_and_vllm_spellings(oai):
    out = chat(oai, response_format={"type": "json_object"}, max_tokens=60)
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:
        assert out.choices[0].message.content.startswith("{")
    out = chat(oai, extra_body={"guided_regex": "[0-9]{2}-[a-z]{3}"})
    assert len(out.choices[0].message.content) == 6
    out = chat(oai, extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert out.choices[0].message.content in ("red", "green")
    out = oai.completions.create(model="tiny", prompt="The answer:", max_tokens=10,
                                 temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("kwargs, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bad"}}}},
     "response_format", "bad"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "structured_outputs", "parenthesis"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_regex", "one"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name", "name"),
])
def test_bad_structured_requests_get_a_400_naming_the_field(oai, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        chat(oai, **kwargs)
    error = info.value.body
    assert error["param"] == param and words in error["message"], error


def check_call(call, tool) -> dict:
    assert call.type == "function" and call.id
    assert call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    assert set(args) == set(tool["function"]["parameters"]["required"])
    return args


def test_tool_choice_named_and_required_always_parse(oai):
    out = chat(oai, tools=[WEATHER, TIME], max_tokens=160,
               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    args = check_call(choice.message.tool_calls[0], WEATHER)
    assert args["unit"] in ("celsius", "fahrenheit")
    out = chat(oai, tools=[WEATHER, TIME], tool_choice="required", max_tokens=160)
    call = out.choices[0].message.tool_calls[0]
    check_call(call, WEATHER if call.function.name == "get_weather" else TIME)


def test_streamed_tool_calls_match_the_whole_reply(oai):
    kwargs = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 160}
    whole = chat(oai, **kwargs).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chat(oai, stream=True, **kwargs):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert calls == {0: {"name": whole.function.name, "arguments": whole.function.arguments}}


def test_tool_results_go_back_in(oai):
    first = chat(oai, tools=[WEATHER], tool_choice="required", max_tokens=160)
    first = first.choices[0].message
    call = first.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": call.function.name,
                                      "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    out = chat(oai, messages=messages, tools=[WEATHER], max_tokens=12)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert out.usage.prompt_tokens > chat(oai, max_tokens=1).usage.prompt_tokens + 20


def test_hostile_schema_is_refused_without_stalling_a_stream(oai, server):
    hostile = {"type": "object", "required": [f"k{i}" for i in range(60)],
               "properties": {f"k{i}": {"type": "string",
                                        "pattern": "^[a-z]{1,300}[0-9]{3,400}$"}
                              for i in range(60)}}
    compiler = server.core.grammars
    compiler.timeout_s, saved = 0.2, compiler.timeout_s
    arrivals: list[float] = []

    def stream():
        for _ in chat(oai, stream=True, max_tokens=60, temperature=0,
                      extra_body={"ignore_eos": True}):
            arrivals.append(time.monotonic())

    reader = threading.Thread(target=stream)
    try:
        reader.start()
        while not arrivals:
            time.sleep(0.01)
        start = time.monotonic()
        with pytest.raises(openai.BadRequestError) as info:
            chat(oai, response_format={"type": "json_schema",
                                       "json_schema": {"name": "h", "schema": hostile}})
        refused = time.monotonic()
        reader.join(120)
    finally:
        compiler.timeout_s = saved
    assert "did not compile within" in info.value.body["message"]
    assert refused - start < 5
    # The stream kept flowing while the schema compiled (and after it was refused): no long
    # pause in its chunks.
    after = [t for t in arrivals if t >= start]
    assert after, "the stream stalled"
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert max(gaps) < 3.0, gaps


def test_websocket_structured_field(server):
    async def go():
        async with WSConn(server.ws) as conn:
            await conn.create("ok", messages=ASK, temperature=0, max_output_tokens=80,
                              structured={"json": SCHEMA})
            await conn.create("bad", messages=ASK, structured={"regex": "(open"})
            await conn.create("two", messages=ASK, structured={"regex": "a", "choice": ["a"]})
            return await conn.until_done("ok", "bad", "two", timeout=120)
    events = run(go(), timeout=150)
    assert events["ok"][-1]["type"] == "response.done"
    assert list(json.loads(text_of(events["ok"]))) == ["city", "population", "coastal"]
    for rid in ("bad", "two"):
        error = events[rid][-1]
        assert error["type"] == "error" and error["code"] == "invalid_field", error
        assert error["param"] == "response.structured", error
    assert "parenthesis" in events["bad"][-1]["message"]


def test_sdk_parse_with_a_pydantic_model(oai):
    """The SDK's `parse` (what LangChain's `with_structured_output` uses): a strict json_schema
    from a pydantic model, parsed back into the model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=12)
        population: int
        size: Literal["small", "large"]

    out = oai.chat.completions.parse(model="tiny", messages=ASK, response_format=City,
                                     temperature=0, max_tokens=80)
    city = out.choices[0].message.parsed
    assert isinstance(city, City) and city.size in ("small", "large")
