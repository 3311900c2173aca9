"""`StructuredOutput`: what a request's output must match, as plain data.

Five kinds, the ones OpenAI's `response_format` and vLLM's `guided_*` fields name:
- `json_schema`: a JSON Schema (kept as its JSON text, property order preserved: it is the
  order the output writes the keys in);
- `json_object`: any JSON object;
- `regex`: a regular expression the whole output matches;
- `grammar`: an EBNF grammar in GBNF notation (`root ::= ...`), as llama.cpp and xgrammar take;
- `choice`: one of a list of strings, verbatim.

`prefix` and `suffix` are literal text around the constrained part (a tool call's
`<tool_call>\\n` ... `\\n</tool_call>` wrapper). Construction checks shape and size only; whether
a schema or grammar compiles is `compiler.py`'s job (it says what is wrong).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
# Bounds what one request can make the compiler chew on (a hostile schema is refused before
# compiling; the compile time cap in compiler.py covers the rest).
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256


@dataclass(frozen=True)
class StructuredOutput:
    kind: str
    value: str = ""  # schema JSON text, regex, grammar text, or choices as a JSON list
    prefix: str = ""
    suffix: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, "
                             f"got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError(f"{self.kind} must be given as text")
        size = len(self.value) + len(self.prefix) + len(self.suffix)
        if size > MAX_SPEC_CHARS:
            raise ValueError(f"the {self.kind} has {size} characters; the limit is "
                             f"{MAX_SPEC_CHARS}")
        if self.kind in ("regex", "grammar") and not self.value.strip():
            raise ValueError(f"the {self.kind} is empty")

    # ---- constructors ---------------------------------------------------------------------
    @classmethod
    def json(cls, schema: dict | bool | str, prefix: str = "", suffix: str = ""
             ) -> StructuredOutput:
        """A JSON Schema, as a dict (or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False), prefix, suffix)

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredOutput:
        return cls("grammar", ebnf)

    @classmethod
    def choice(cls, options: Sequence[str]) -> StructuredOutput:
        options = list(options)
        if not options or len(options) > MAX_CHOICES or \
                any(not isinstance(o, str) or not o for o in options):
            raise ValueError(f"choice must be 1 to {MAX_CHOICES} non-empty strings")
        return cls("choice", json.dumps(options, ensure_ascii=False))

    @property
    def schema(self) -> dict | bool | None:
        return json.loads(self.value) if self.kind == "json_schema" else None
