"""Constrained speculative sampling keeps the masked target distribution (statistical).

Tiny random models (vocabulary 320, a byte-level BPE) sample under the regex `[a-h]+` with and
without speculation, from seeded requests; the distributions of each output position and of a
joint pair are compared with two-sample chi-square tests (as test_spec_sampling.py does for free
text). A control shows the test has power: the draft's own constrained distribution is told
apart from the target's.
"""

from __future__ import annotations

import re

import pytest

from specserve import LLM, SamplingParams
from specserve.structured import StructuredOutput
from tests.speculation.test_spec_sampling import P_MIN, assert_same_distribution, chi2_p

N = 1000
PROMPT = [5, 9, 3, 17, 11]
REGEX = "[a-h]+"


def sample(target, draft, speculation, seed0):
    llm = LLM(target, draft, speculation=speculation, max_num_seqs=512,
              max_num_batched_tokens=8192, num_blocks=4096, block_size=16)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=seed0 + i, max_tokens=4,
                             structured=StructuredOutput.regex(REGEX)) for i in range(N)]
    outs = llm.generate([PROMPT] * N, params)
    llm.engine.block_manager.check_no_leak()
    for o in outs:
        # EOS is allowed once the regex matched; everything before it matches.
        text = llm.tokenizer.decode([t for t in o.token_ids if t not in llm.engine.eos_token_ids])
        assert re.fullmatch(REGEX, text), text
    # Shorter outputs (EOS sampled) pad with -1: the end is part of the distribution.
    return [tuple(o.token_ids) + (-1,) * (4 - len(o.token_ids)) for o in outs], llm.engine.stats


@pytest.fixture(scope="module")
def reference(tiny_target):
    return sample(tiny_target, None, "off", seed0=10**6)[0]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain:3", "tree:8", "ngram:2"])
def test_constrained_speculative_sampling_matches_target(tiny_target, tiny_draft, reference,
                                                         mode):
    samples, stats = sample(tiny_target, tiny_draft if mode != "ngram:2" else None, mode, 0)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both verdicts happened
    assert_same_distribution(samples, reference, mode)


@pytest.mark.slow
def test_control_draft_distribution_is_rejected(tiny_draft, reference):
    samples, _ = sample(tiny_draft, None, "off", seed0=5 * 10**6)
    assert min(chi2_p([s[pos] for s in samples], [s[pos] for s in reference])
               for pos in (1, 2)) < P_MIN
