"""bench.agreement's counting: tokens shared from the start of two continuations, and the
prompt text llama.cpp reads."""

from __future__ import annotations

import pytest

from bench.agreement import divergence_gap, same_text, shared_tokens
from bench.cpu_paths import llamacpp_prompt_text


class Letters:
    """A tokenizer whose token i is the letter chr(ord('a') + i); token 25 is BOS ("<s>"), a
    special token."""

    bos_token_id = 25

    def decode(self, ids, skip_special_tokens=False):
        bos = "" if skip_special_tokens else "<s>"
        return "".join(bos if i == 25 else chr(ord("a") + i) for i in ids)


def test_shared_tokens_counts_the_common_start():
    tok = Letters()
    assert shared_tokens(tok, [0, 1, 2], "abc") == 3
    assert shared_tokens(tok, [0, 1, 2], "abd") == 2
    assert shared_tokens(tok, [0, 1, 2], "abcdef") == 3  # llama.cpp's text may run on
    assert shared_tokens(tok, [3, 1], "abc") == 0
    assert shared_tokens(tok, [], "abc") == 0
    assert shared_tokens(tok, [0, 1, 25], "ab") == 3  # the end of the reply prints nothing


def test_same_text_ignores_special_tokens_and_the_final_newline():
    tok = Letters()
    assert same_text(tok, [0, 1, 25], "ab\n")
    assert not same_text(tok, [0, 1], "abc")


def test_llamacpp_prompt_text_leaves_out_a_leading_bos_only():
    tok = Letters()
    assert [llamacpp_prompt_text(tok, p) for p in ([25, 0, 1], [0, 25, 1], [2])] == [
        "ab", "a<s>b", "c"]


def test_divergence_gap_finds_llamacpps_token_among_the_top():
    from specserve.outputs import TokenLogprob

    tok = Letters()
    logprobs = [TokenLogprob(0, -0.1, [(0, -0.1), (1, -2.3)]),
                TokenLogprob(1, -0.5, [(1, -0.5), (2, -0.6), (3, -1.0)])]
    assert divergence_gap(tok, [0, 1], logprobs, "ac", 1) == pytest.approx(0.1)
    assert divergence_gap(tok, [0, 1], logprobs, "ad", 1) == pytest.approx(0.5)
    assert divergence_gap(tok, [0, 1], logprobs, "ax", 1) is None
