"""bench.agreement's counting: tokens shared from the start of two continuations, and the
prompt text llama.cpp reads."""

from __future__ import annotations

from bench.agreement import prompt_texts, shared_tokens


class Letters:
    """A tokenizer whose token i is the letter chr(ord('a') + i); token 25 is BOS ("<s>")."""

    bos_token_id = 25

    def decode(self, ids):
        return "".join("<s>" if i == 25 else chr(ord("a") + i) for i in ids)


def test_shared_tokens_counts_the_common_start():
    tok = Letters()
    assert shared_tokens(tok, [0, 1, 2], "abc") == 3
    assert shared_tokens(tok, [0, 1, 2], "abd") == 2
    assert shared_tokens(tok, [0, 1, 2], "abcdef") == 3  # llama.cpp's text may run on
    assert shared_tokens(tok, [3, 1], "abc") == 0
    assert shared_tokens(tok, [], "abc") == 0


def test_prompt_text_leaves_out_a_leading_bos_only():
    tok = Letters()
    assert prompt_texts(tok, [[25, 0, 1], [0, 25, 1], [2]]) == ["ab", "a<s>b", "c"]
