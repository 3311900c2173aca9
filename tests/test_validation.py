"""specserve.validation on its own: the checks every entry point shares, without a server."""

from __future__ import annotations

import msgspec
import pytest
from transformers import AutoTokenizer

from specserve.speculation.modes import OFF
from specserve.validation import (
    MAX_STOP_STRINGS,
    MAX_TREE_DEPTH,
    MAX_TREE_NODES,
    STANDARD_ROLES,
    ModelFacts,
    RequestError,
    RequestLimits,
    SpeculationSpec,
    check_lengths,
    check_prompt_ids,
    check_speculation,
    check_stop,
    message_text,
    prepare_request,
    template_roles,
)

LIMITS = RequestLimits.for_context(512)


@pytest.fixture(scope="module")
def facts(tiny_target) -> ModelFacts:
    tok = AutoTokenizer.from_pretrained(tiny_target)
    return ModelFacts(tokenizer=tok, vocab_size=320, has_draft=True, default_mode=OFF,
                      roles=template_roles(tok.chat_template))


def _code(call, *args, **kwargs) -> tuple[str, str | None]:
    with pytest.raises(RequestError) as info:
        call(*args, **kwargs)
    return info.value.code, info.value.param


def test_template_roles():
    generic = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{% endfor %}"
    assert template_roles(generic) == frozenset(STANDARD_ROLES)
    assert template_roles("{{ '<|' + message.role + '|>' }}") == frozenset(STANDARD_ROLES)
    compares = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}"
                "{% elif m['role'] == 'system' %}<<SYS>>{% endif %}{% endfor %}")
    assert template_roles(compares) == {"user", "assistant", "system"}
    assert template_roles(None) == frozenset(STANDARD_ROLES)


def test_message_content_parts():
    assert message_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                        "c") == "ab"
    assert message_text(None, "c") == ""
    assert _code(message_text, [{"type": "text", "text": 5}], "c") == ("invalid_field",
                                                                       "c[0].text")
    assert _code(message_text, [{"type": "image_url"}], "c") == ("invalid_field", "c[0].type")
    assert _code(message_text, 7, "c") == ("invalid_field", "c")


def test_stop_and_tree_caps():
    assert check_stop(["a", "b"]) == ("a", "b") and check_stop("x") == ("x",)
    assert _code(check_stop, ["s"] * (MAX_STOP_STRINGS + 1))[0] == "invalid_field"
    assert _code(check_stop, [""])[0] == "invalid_field"
    wide = [[i] for i in range(MAX_TREE_NODES + 1)]
    assert _code(check_speculation, wide, True) == ("invalid_field", "speculation")
    assert _code(check_speculation, [[0] * (MAX_TREE_DEPTH + 1)], True)[0] == "invalid_field"
    assert check_speculation([[0], [1], [0, 0]], True).num_tokens == 3
    assert _code(check_speculation, "chain:2", False)[0] == "invalid_field"  # needs a draft
    # The msgspec type the wire structs use says the same.
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(wide, SpeculationSpec)
    assert msgspec.convert([[0], [0, 1]], SpeculationSpec) == [[0], [0, 1]]


def test_lengths_and_ids():
    assert check_lengths(10, None, LIMITS) == min(LIMITS.default_max_output_tokens, 512 - 10)
    assert check_lengths(10, 5, LIMITS) == 5
    assert _code(check_lengths, 600, None, LIMITS) == ("prompt_too_long", "prompt")
    assert _code(check_lengths, 500, 100, LIMITS) == ("prompt_too_long", "max_output_tokens")
    assert _code(check_lengths, 5, 0, LIMITS) == ("invalid_field", "max_output_tokens")
    assert _code(check_prompt_ids, [1, 320], 320)[0] == "invalid_field"
    assert _code(check_prompt_ids, [True], 320)[0] == "invalid_field"
    assert _code(check_prompt_ids, [], 320)[0] == "invalid_field"


def test_prepare_request_applies_the_template_and_the_byte_cap_first(facts):
    prepared = prepare_request(facts, LIMITS, messages=[{"role": "user", "content": "hi"}],
                               max_output_tokens=4, stop="x")
    tok = facts.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   add_generation_prompt=True, tokenize=False)
    assert prepared.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert prepared.params.max_tokens == 4 and prepared.params.stop == ("x",)

    class NoTokenizer:
        def __getattr__(self, name):
            raise AssertionError(f"tokenizer.{name} used on a request over the byte cap")

    capped = ModelFacts(NoTokenizer(), 320, True, OFF)
    huge = "x" * (LIMITS.prompt_byte_cap + 1)
    assert _code(prepare_request, capped, LIMITS, prompt=huge) == ("prompt_too_long", "prompt")
    assert _code(prepare_request, capped, LIMITS,
                 messages=[{"role": "user", "content": huge}])[0] == "prompt_too_long"
    assert _code(prepare_request, capped, LIMITS,
                 messages=[{"role": "wizard", "content": "x"}]) == ("invalid_field",
                                                                   "messages[0].role")
    assert _code(prepare_request, capped, LIMITS, prompt="x", stop=[""] )[0] == "invalid_field"


def test_a_request_error_is_a_value_error():
    """The engine and `LLM` raise ValueError for bad requests; callers keep catching that."""
    assert issubclass(RequestError, ValueError)
