"""Structured output in the engine: outputs match their schema, greedy constrained output is the
same in every speculation mode, the grammar's end ends the request, bad specs are refused.

The demo pair (a real tokenizer and a trained draft) runs the greedy checks; the statistical
check of constrained sampling is in test_structured_sampling.py.
"""

from __future__ import annotations

import json
import re

import pytest

from specserve import LLM, SamplingParams
from specserve.structured import StructuredOutput
from specserve.structured.compiler import GrammarError

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                  "maxItems": 3},
                         "active": {"type": "boolean"}},
          "required": ["name", "age", "tags", "active"]}
PROMPTS = ["Tell me about a person.", "def add(a, b):", "Once upon a time"]
MODES = ["off", "chain:4", "tree", "static:small", "ngram:3", "adaptive"]


@pytest.fixture(scope="module")
def demo():
    return LLM("demo")


def check_schema(value: dict) -> None:
    assert list(value) == ["name", "age", "tags", "active"]  # schema order, nothing else
    assert isinstance(value["name"], str) and len(value["name"]) <= 16
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    assert all(t in "abc" for t in value["tags"]) and len(value["tags"]) <= 3
    assert isinstance(value["active"], bool)


@pytest.mark.slow
def test_greedy_json_schema_same_in_every_mode(demo):
    params = SamplingParams(temperature=0, max_tokens=96,
                            structured=StructuredOutput.json(SCHEMA))
    by_mode = {}
    for mode in MODES:
        outs = demo.generate(PROMPTS[:2], params, speculation=mode)
        by_mode[mode] = [o.token_ids for o in outs]
        for o in outs:
            assert o.finish_reason == "stop", (mode, o.text)
            check_schema(json.loads(o.text))
        if mode != "off":
            assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0, mode
    demo.engine.block_manager.check_no_leak()
    for mode in MODES[1:]:
        assert by_mode[mode] == by_mode["off"], mode


@pytest.mark.slow
@pytest.mark.parametrize("spec, pattern", [
    (StructuredOutput.regex(r"[0-9]{3}-[a-z]{2,5}"), r"[0-9]{3}-[a-z]{2,5}"),
    (StructuredOutput.choice(["yes", "no", "maybe not"]), r"yes|no|maybe not"),
    (StructuredOutput.grammar('root ::= "(" [a-c]+ ")" | "[" root "]"'),
     r"\[*\([a-c]+\)\]*"),
])
def test_regex_choice_grammar_greedy(demo, spec, pattern):
    params = SamplingParams(temperature=0, max_tokens=24, structured=spec)
    off = demo.generate(PROMPTS[:2], params, speculation="off")
    tree = demo.generate(PROMPTS[:2], params, speculation="tree")
    for a, b in zip(off, tree):
        assert a.token_ids == b.token_ids
        if a.finish_reason == "stop":
            assert re.fullmatch(pattern, a.text), a.text
        else:  # max_tokens first: a prefix of a match
            assert a.finish_reason == "length"


def test_unconstrained_output_is_unchanged(demo):
    """A request without a grammar beside a constrained one decodes as it does alone."""
    free = SamplingParams(temperature=0, max_tokens=20)
    alone = demo.generate(PROMPTS[:1], free, speculation="tree")[0]
    mixed = demo.generate(PROMPTS[:2], [free, SamplingParams(
        temperature=0, max_tokens=20, structured=StructuredOutput.json_object())],
        speculation="tree")
    assert mixed[0].token_ids == alone.token_ids
    assert mixed[1].text.startswith("{")


def test_grammar_end_finishes_even_with_ignore_eos(demo):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                            structured=StructuredOutput.choice(["alpha", "beta"]))
    out = demo.generate(PROMPTS[:1], params, speculation="chain:4")[0]
    # The stop token the grammar ends with is output (ignore_eos keeps it); nothing after it.
    assert out.finish_reason == "stop" and out.token_ids[-1] in demo.engine.eos_token_ids
    assert demo.tokenizer.decode(out.token_ids[:-1]) in ("alpha", "beta")
    demo.engine.block_manager.check_no_leak()


@pytest.mark.parametrize("spec, words", [
    (StructuredOutput("json_schema", '{"type": "nonsense"}'), "nonsense"),
    (StructuredOutput.regex("(ab"), "parenthesis"),
    (StructuredOutput.grammar('root ::= "a" undefined_rule'), "undefined_rule"),
])
def test_bad_specs_are_refused_with_the_reason(demo, spec, words):
    with pytest.raises(GrammarError, match=words):
        demo.generate("hi", SamplingParams(max_tokens=4, structured=spec))
    assert not demo.engine.requests  # nothing queued, nothing held
    demo.engine.block_manager.check_no_leak()


def test_spec_construction_checks():
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutput.json("{nope")
    with pytest.raises(ValueError, match="limit"):
        StructuredOutput.regex("a" * 70_000)
    with pytest.raises(ValueError, match="kind"):
        StructuredOutput("yaml", "x")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutput.choice([])
    with pytest.raises(ValueError, match="StructuredOutput"):
        SamplingParams(structured={"type": "json_object"})
