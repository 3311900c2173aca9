"""Speculative sampling preserves the target's distribution (statistical, fixed seeds).

On a 24-token vocabulary, thousands of seeded requests sample their first tokens with and
without speculation. The tokens after the first come out of speculation steps (the first is
sampled from the prompt forward alone), so their distributions are compared with two-sample
chi-square tests. A control shows the test has power: the draft's own distribution, which
differs from the target's, is rejected.
"""

from __future__ import annotations

from collections import Counter

import pytest
from scipy.stats import chi2_contingency

from specserve import LLM, SamplingParams
from tests.tiny_models import save_model

N = 2500
PROMPT = [5, 9, 3, 17, 11]
P_MIN = 1e-3


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    base = tmp_path_factory.mktemp("tinyvocab")
    # Different seeds: the draft agrees with the target only sometimes, so both acceptance and
    # rejection paths run; a larger init spread keeps the distributions far from uniform.
    target = save_model(base / "t", "llama", seed=21, vocab_size=24, eos_token_id=2)
    draft = save_model(base / "d", "llama", seed=22, vocab_size=24, eos_token_id=2,
                       num_hidden_layers=1)
    return target, draft


def sample(target, draft, speculation, n=N, seed0=0, **params):
    llm = LLM(target, draft, speculation=speculation, max_num_seqs=512,
              max_num_batched_tokens=8192, num_blocks=4096, block_size=16)
    sp = [SamplingParams(temperature=0.8, top_p=0.9, seed=seed0 + i, max_tokens=4,
                         ignore_eos=True, **params) for i in range(n)]
    outs = llm.generate([PROMPT] * n, sp)
    llm.engine.block_manager.check_no_leak()
    return [tuple(o.token_ids) for o in outs], llm.engine.stats


def chi2_p(a: list, b: list) -> float:
    """Two-sample chi-square p-value over categories (rare ones pooled)."""
    ca, cb = Counter(a), Counter(b)
    cats = sorted(set(ca) | set(cb), key=lambda c: -(ca[c] + cb[c]))
    common = [c for c in cats if ca[c] + cb[c] >= 20]
    rest = [c for c in cats if c not in common]
    rows = [[ca[c] for c in common] + [sum(ca[c] for c in rest)],
            [cb[c] for c in common] + [sum(cb[c] for c in rest)]]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    return chi2_contingency(rows)[1]


def assert_same_distribution(samples: list, reference: list, label: str) -> None:
    """Tokens 2, 3 and 4 one by one, and tokens 2-3 jointly, match the reference's."""
    for pos in (1, 2, 3):
        p = chi2_p([s[pos] for s in samples], [s[pos] for s in reference])
        assert p > P_MIN, f"{label}: token {pos + 1} distribution differs (p={p:.2e})"
    p = chi2_p([s[1:3] for s in samples], [s[1:3] for s in reference])
    assert p > P_MIN, f"{label}: joint of tokens 2-3 differs (p={p:.2e})"


@pytest.fixture(scope="module")
def reference(tiny_vocab):
    target, _ = tiny_vocab
    samples, _ = sample(target, None, "off", seed0=10**6)
    return samples


@pytest.mark.slow
# suffix: every earlier sample's text is in the store, so its trees hold several candidates.
@pytest.mark.parametrize("mode", ["chain:3", "tree:8", "static:small", "suffix"])
def test_speculative_sampling_matches_target(tiny_vocab, reference, mode):
    target, draft = tiny_vocab
    samples, stats = sample(target, draft, mode)
    # Both paths of the rejection sampler ran.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_same_distribution(samples, reference, mode)


@pytest.mark.slow
def test_control_draft_distribution_is_rejected(tiny_vocab, reference):
    """The same test tells the draft's distribution apart from the target's."""
    _, draft = tiny_vocab
    samples, _ = sample(draft, None, "off", seed0=5 * 10**6)
    assert chi2_p([s[1] for s in samples], [s[1] for s in reference]) < P_MIN
