"""OpenAI tool calling over a chat template: tools in, `tool_calls` out.

Two output formats, chosen by what the model's chat template knows:
- **hermes** (Qwen2.5/3, Hermes, SmolLM2/3 and templates without tool support): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. A template that has no tool
  support gets the tool list in its system message, in the words Qwen's template uses, and
  earlier calls and tool results rendered as text.
- **llama3** (templates that write `<|python_tag|>` / `ipython`): the whole reply is one JSON
  object `{"name": ..., "parameters": {...}}`.
A template that takes `tools` renders them itself (`native`); the others get them rendered here.

`tool_choice` "required" or a named function constrains the output to that format with the
function's parameters schema (a `StructuredOutput` with the call wrapper as prefix/suffix), so
the arguments always parse. "auto" leaves the model free; its calls are parsed out of the text.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from .spec import StructuredOutput

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class ToolError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass
class ToolPlan:
    """How one chat request uses its tools."""

    tools: list[Tool]
    choice: str  # "auto" | "required" | "named"
    named: str | None  # the function tool_choice names
    fmt: str  # "hermes" | "llama3"
    native: bool  # the chat template renders the tools itself

    def constraint(self) -> StructuredOutput | None:
        """The output constraint of "required" / a named function (None for "auto")."""
        if self.choice == "auto":
            return None
        tools = [t for t in self.tools if self.choice == "required" or t.name == self.named]
        key = "parameters" if self.fmt == "llama3" else "arguments"
        calls = [{"type": "object",
                  "properties": {"name": {"const": t.name}, key: t.parameters},
                  "required": ["name", key]} for t in tools]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if self.fmt == "llama3":
            return StructuredOutput.json(schema)
        return StructuredOutput.json(schema, prefix=HERMES_OPEN + "\n", suffix="\n" + HERMES_CLOSE)

    def openai_tools(self) -> list[dict]:
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}}
                for t in self.tools]


def template_format(template: str | None) -> tuple[str, bool]:
    """(output format, whether the template renders `tools` itself)."""
    template = template or ""
    native = "tools" in template
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3", native
    return "hermes", native


def plan_tools(tools: Sequence[dict] | None, tool_choice, template: str | None
               ) -> ToolPlan | None:
    """Check `tools` and `tool_choice`; None when no tool is to be offered."""
    if not tools or tool_choice == "none":
        if isinstance(tool_choice, dict) or tool_choice == "required":
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    parsed, names = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(fn, dict):
            raise ToolError("each tool must be {\"type\": \"function\", \"function\": {...}}",
                            f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ToolError("a function name must be 1-64 letters, digits, _ . or -",
                            f"tools[{i}].function.name")
        if name in names:
            raise ToolError(f"two tools are named {name!r}", f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError("parameters must be a JSON schema object",
                            f"tools[{i}].function.parameters")
        names.add(name)
        parsed.append(Tool(name, str(fn.get("description") or ""), params))
    named = None
    if tool_choice in (None, "auto"):
        choice = "auto"
    elif tool_choice == "required":
        choice = "required"
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        choice, named = "named", tool_choice["function"].get("name")
        if named not in names:
            raise ToolError(f"tool_choice names {named!r}, which is not among the tools",
                            "tool_choice")
    else:
        raise ToolError("tool_choice must be \"none\", \"auto\", \"required\" or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    fmt, native = template_format(template)
    return ToolPlan(parsed, choice, named, fmt, native)


# ---- prompts --------------------------------------------------------------------------------
def tools_system_text(plan: ToolPlan) -> str:
    """The tool list as a system message for templates without tool support (Hermes style)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.openai_tools())
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listing}\n</tools>\n\nFor each function call, return a json object "
            "with function name and arguments within <tool_call></tool_call> XML tags:\n"
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
            "</tool_call>")


def render_messages(messages: list[dict], plan: ToolPlan | None,
                    roles: frozenset[str]) -> list[dict]:
    """OpenAI messages (with `tool_calls`, `tool` results) as messages a template without tool
    support renders: calls and results become text in the model's format."""
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [_call_text(c, plan.fmt if plan else "hermes") for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        elif role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
            role = "tool" if "tool" in roles else "user"
        out.append({"role": role, "content": content})
    if plan is not None and not plan.native:
        system = tools_system_text(plan)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _call_text(call: dict, fmt: str) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments") or "{}"
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass
    if fmt == "llama3":
        return json.dumps({"name": fn.get("name"), "parameters": args}, ensure_ascii=False)
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}"


# ---- outputs --------------------------------------------------------------------------------
def _openai_call(obj, names: set[str]) -> dict | None:
    """{"name", "arguments"|"parameters"} -> an OpenAI tool call (None if it is not one)."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": "call_" + secrets.token_hex(12), "type": "function",
            "function": {"name": obj["name"],
                         "arguments": json.dumps(args, ensure_ascii=False)}}


def _parse_json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """A finished reply -> (content, tool calls). Text that is not a well-formed call of a
    known function stays content."""
    names = {t.name for t in plan.tools}
    if plan.fmt == "llama3":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        call = _openai_call(_parse_json(body), names) if body.startswith("{") else None
        return (None, [call]) if call else (text or None, [])
    calls, kept, last = [], [], 0
    for match in _HERMES_CALL.finditer(text):
        call = _openai_call(_parse_json(match.group(1)), names)
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return content or None, calls


@dataclass
class ToolCallStream:
    """Streaming: text deltas in, (content delta, finished tool calls) out.

    Content streams as it comes, except a tail that could be the start of a call marker; a call
    is held until it is complete, then sent whole as one `tool_calls` delta (the arguments in
    one piece, which OpenAI clients accumulate the same way).
    """

    plan: ToolPlan
    _buffer: str = ""
    _in_call: bool = False
    _text_seen: bool = False
    num_calls: int = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.plan.fmt == "llama3":
            return self._feed_llama3(text)
        self._buffer += text
        content, calls = "", []
        while True:
            if not self._in_call:
                start = self._buffer.find(HERMES_OPEN)
                if start < 0:
                    keep = _marker_prefix_len(self._buffer, HERMES_OPEN)
                    cut = len(self._buffer) - keep
                    content += self._buffer[:cut]
                    self._buffer = self._buffer[cut:]
                    return content, calls
                content += self._buffer[:start]
                self._buffer = self._buffer[start:]
                self._in_call = True
            end = self._buffer.find(HERMES_CLOSE)
            if end < 0:
                return content, calls
            block = self._buffer[:end + len(HERMES_CLOSE)]
            self._buffer = self._buffer[end + len(HERMES_CLOSE):]
            self._in_call = False
            _, parsed = parse_tool_calls(block, self.plan)
            if parsed:
                calls += parsed
            else:
                content += block  # not a call of a known function: it was text
            self.num_calls += len(parsed)

    def _feed_llama3(self, text: str) -> tuple[str, list[dict]]:
        if not self._text_seen:
            self._buffer += text
            head = self._buffer.lstrip()
            if not head:
                return "", []
            if head.startswith(("{", "<|python_tag|>")):
                return "", []  # a call, perhaps: held until the end
            self._text_seen = True
            out, self._buffer = self._buffer, ""
            return out, []
        return text, []

    def finish(self) -> tuple[str, list[dict]]:
        """The end of the reply: what is still held, as content or a last call."""
        rest, self._buffer = self._buffer, ""
        if self.plan.fmt == "llama3" and not self._text_seen:
            content, calls = parse_tool_calls(rest, self.plan)
            self.num_calls += len(calls)
            return content or "", calls
        return rest, []


def _marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
