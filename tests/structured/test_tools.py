"""Tool plans, prompts and reply parsing without a model (hermes and llama3 formats)."""

from __future__ import annotations

import json

import pytest

from specserve.structured.tools import (
    ToolCallStream,
    ToolError,
    parse_tool_calls,
    plan_tools,
    render_messages,
    template_format,
)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_plans_and_their_errors():
    assert plan_tools(TOOLS, "none", None) is None and plan_tools(None, None, None) is None
    plan = plan_tools(TOOLS, None, None)
    assert (plan.choice, plan.fmt, plan.native) == ("auto", "hermes", False)
    assert plan.constraint() is None
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    spec = named.constraint()
    assert spec.prefix == "<tool_call>\n" and spec.suffix == "\n</tool_call>"
    assert spec.schema["properties"]["name"] == {"const": "get_weather"}
    llama = plan_tools(TOOLS, "required", "{{ '<|python_tag|>' }} {% if tools %}{% endif %}")
    assert (llama.fmt, llama.native) == ("llama3", True)
    assert "parameters" in llama.constraint().schema["properties"]
    with pytest.raises(ToolError) as info:
        plan_tools(None, "required", None)
    assert info.value.param == "tool_choice"
    with pytest.raises(ToolError) as info:
        plan_tools([TOOLS[0], TOOLS[0]], None, None)
    assert info.value.param == "tools[1].function.name"
    assert template_format("{{ messages }}") == ("hermes", False)


def test_parse_keeps_text_and_unknown_calls_as_content():
    plan = plan_tools(TOOLS, None, None)
    content, calls = parse_tool_calls("Let me look.\n" + CALL, plan)
    assert content == "Let me look." and len(calls) == 1
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    text = '<tool_call>{"name": "other", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, plan) == (text, [])
    assert parse_tool_calls("just text", plan) == ("just text", [])


@pytest.mark.parametrize("cut", [1, 3, 7, 11, 30])
def test_stream_holds_back_markers_and_sends_whole_calls(cut):
    plan = plan_tools(TOOLS, None, None)
    reply = "Sure. " + CALL + " done"
    stream, content, calls = ToolCallStream(plan), "", []
    for i in range(0, len(reply), cut):
        text, new = stream.feed(reply[i:i + cut])
        assert "<" not in text  # neither a call nor a marker's first characters leak out
        content += text
        calls += new
    text, new = stream.finish()
    content, calls = content + text, calls + new
    assert content == "Sure.  done" and len(calls) == 1 and stream.num_calls == 1
    assert calls[0]["function"]["name"] == "get_weather"


def test_llama3_stream_and_render():
    plan = plan_tools(TOOLS, None, "ipython")
    stream = ToolCallStream(plan)
    assert stream.feed('{"name": "get_weather", ') == ("", [])
    assert stream.feed('"parameters": {"city": "Rome"}}') == ("", [])
    content, calls = stream.finish()
    assert content == "" and calls[0]["function"]["name"] == "get_weather"
    text_stream = ToolCallStream(plan)
    assert text_stream.feed("Hello") == ("Hello", [])
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "content": "sunny"}]
    rendered = render_messages(messages, plan, frozenset({"system", "user", "assistant"}))
    assert rendered[0]["role"] == "system" and "<tools>" in rendered[0]["content"]
    assert json.loads(rendered[2]["content"]) == {"name": "get_weather",
                                                  "parameters": {"city": "Rome"}}
    assert rendered[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
