"""Wire spellings of structured output -> `StructuredOutput`, errors naming the field.

- OpenAI `response_format`: `{"type": "text"}`, `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`.
- vLLM: `structured_outputs` `{"json" | "regex" | "grammar" | "choice": ...}` (also `"json_object":
  true`), and the older top-level `guided_json`, `guided_regex`, `guided_grammar`, `guided_choice`.
- The WebSocket request's `structured` object uses the vLLM keys (docs/PROTOCOL.md).
At most one of them per request.
"""

from __future__ import annotations

from ..validation import RequestError
from .spec import StructuredOutput

_VLLM_KEYS = ("json", "regex", "grammar", "choice", "json_object")


def _invalid(message: str, param: str) -> RequestError:
    return RequestError("invalid_field", message, param)


def _build(kind: str, value, param: str) -> StructuredOutput:
    try:
        if kind == "json":
            return StructuredOutput.json(value)
        if kind == "json_object":
            if value is not True:
                raise ValueError("json_object must be true")
            return StructuredOutput.json_object()
        if kind == "choice":
            if not isinstance(value, list):
                raise ValueError("choice must be a list of strings")
            return StructuredOutput.choice(value)
        if not isinstance(value, str):
            raise ValueError(f"{kind} must be a string")
        return StructuredOutput(kind, value)
    except ValueError as exc:
        raise _invalid(str(exc), param) from None


def from_response_format(fmt: dict | None, param: str = "response_format"
                         ) -> StructuredOutput | None:
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput.json_object()
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise _invalid("json_schema must be an object with a \"schema\"",
                           f"{param}.json_schema")
        return _build("json", spec["schema"], f"{param}.json_schema.schema")
    raise RequestError("unsupported_field", f"response_format type {kind!r} is not supported; "
                       f"use \"text\", \"json_object\" or \"json_schema\"", f"{param}.type")


def from_vllm(structured_outputs: dict | None = None, param: str = "structured_outputs",
              **guided) -> StructuredOutput | None:
    """vLLM's `structured_outputs` object, or its top-level `guided_*` fields."""
    given = {f"guided_{k}": v for k, v in guided.items() if v is not None}
    if structured_outputs is not None:
        keys = [k for k in _VLLM_KEYS if structured_outputs.get(k) not in (None, False)]
        if len(keys) != 1:
            raise _invalid(f"{param} needs exactly one of {', '.join(_VLLM_KEYS)}", param)
        given[f"{param}.{keys[0]}"] = structured_outputs[keys[0]]
    if len(given) > 1:
        raise _invalid(f"give one structured output, not {' and '.join(given)}",
                       next(iter(given)))
    if not given:
        return None
    name, value = next(iter(given.items()))
    return _build(name.rsplit(".", 1)[-1].removeprefix("guided_"), value, name)


def one_of(*specs: tuple[str, StructuredOutput | None]) -> StructuredOutput | None:
    """The one spec given among several fields (a 400 naming the second when two are)."""
    given = [(name, spec) for name, spec in specs if spec is not None]
    if len(given) > 1:
        raise _invalid(f"{given[0][0]} and {given[1][0]} both constrain the output; give one",
                       given[1][0])
    return given[0][1] if given else None
