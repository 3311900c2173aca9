"""RequestGrammar on its own: path masks agree with a fresh matcher, pruning drops exactly the
rejected subtrees, the bitmask fast path equals the unpacked fallback."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from specserve.model.loader import load_tokenizer
from specserve.speculation.tree import TokenTree
from specserve.structured import StructuredOutput
from specserve.structured.compiler import GrammarCompiler
from specserve.structured.matcher import RequestGrammar, apply_bitmask, unpack_bitmask

V = 320


@pytest.fixture(scope="module")
def setup(tiny_target):
    tok = load_tokenizer(tiny_target)
    compiler = GrammarCompiler(tok, V, {2})
    compiled = compiler.compile(StructuredOutput.regex("(ab|ac)d+"))
    return tok, compiled


def tid(tok, text: str) -> int:
    (token,) = tok.encode(text, add_special_tokens=False)
    return token


def test_path_masks_match_a_fresh_matcher(setup):
    tok, compiled = setup
    grammar = RequestGrammar(compiled, V)
    a, c = tid(tok, "a"), tid(tok, "c")
    fresh = xgr.GrammarMatcher(compiled)
    for token in (a, c):
        assert fresh.accept_token(token)
    expect = xgr.allocate_token_bitmask(1, V)
    fresh.fill_next_token_bitmask(expect, 0)
    assert torch.equal(grammar.row((a, c)), expect[0])
    allowed = unpack_bitmask(grammar.row((a, c))[None], V)[0]
    assert allowed[tid(tok, "d")] and not allowed[tid(tok, "a")]
    assert grammar.row((c,)) is None  # "c" cannot start the output
    # Rolled back: the committed state is untouched by the path walks.
    assert grammar.allows((), a) and not grammar.allows((), c)


def test_prune_drops_rejected_subtrees_and_keeps_rows(setup):
    tok, compiled = setup
    grammar = RequestGrammar(compiled, V)
    a, b, c, d = (tid(tok, x) for x in "abcd")
    # root -> a -> {b -> d, d -> b}, root -> c -> a
    tree = TokenTree(tokens=[99, a, c, b, d, a, d], parents=[-1, 0, 0, 1, 1, 2, 3],
                     draft_rows=[-1, 0, 1, 2, 3, 4, 5])
    pruned = grammar.prune(tree)
    assert pruned.tokens == [99, a, b, d] and pruned.parents == [-1, 0, 1, 2]
    assert pruned.draft_rows == [-1, 0, 2, 5]
    bits = grammar.tree_bitmask(pruned)  # [4, W]
    assert bits.shape == (4, (V + 31) // 32)
    assert unpack_bitmask(bits, V)[3, d]  # after "abd", more d's


def test_commit_and_termination(setup):
    tok, compiled = setup
    grammar = RequestGrammar(compiled, V)
    for text in "abd":
        assert not grammar.commit(tid(tok, text))
    assert grammar.allows((), 2)  # complete: the stop token is allowed
    assert grammar.commit(2) and grammar.is_terminated
    with pytest.raises(RuntimeError, match="not allowed"):
        RequestGrammar(compiled, V).commit(tid(tok, "d"))


def test_bitmask_fast_path_equals_fallback():
    torch.manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (3, 10), dtype=torch.int32)  # [3, W]
    logits = torch.randn(3, V)
    fast = apply_bitmask(logits, bits, V)
    wide = apply_bitmask(torch.cat([logits, torch.randn(3, 8)], -1), bits, V)  # padded vocab
    allowed = unpack_bitmask(bits, V)
    assert torch.equal(fast, logits.masked_fill(~allowed, float("-inf")))
    assert torch.equal(wide[:, :V], fast) and torch.isinf(wide[:, V:]).all()
