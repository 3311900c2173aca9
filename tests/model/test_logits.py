"""specserve's decoder equals transformers' in float32, for every supported family."""

from __future__ import annotations

import pytest
import torch

from specserve.model.loader import load_model
from specserve.model.runner import ModelRunner, Segment
from tests.tiny_models import save_model

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
CASES = {
    "llama-gqa": ("llama", {}),
    "llama-mqa-tied-llama3rope": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True,
                                           "rope_scaling": LLAMA3_ROPE}),
    "qwen2-bias": ("qwen2", {}),
    "mistral": ("mistral", {"num_key_value_heads": 4}),
    "mistral-sliding": ("mistral", {"sliding_window": 6}),
    "qwen3-qknorm": ("qwen3", {}),
    "gemma3-sliding": ("gemma3", {}),
    "gemma3-tied-softcap-linear-rope": ("gemma3", {
        "tie_word_embeddings": True, "final_logit_softcapping": 3.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
}
ATOL = 2e-5


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    arch, overrides = CASES[request.param]
    path = save_model(tmp_path_factory.mktemp(request.param), arch, seed=3, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, load_model(path, dtype="float32")


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_prefill_matches(pair):
    hf, model = pair
    ids = torch.randint(3, 300, (45,), generator=torch.Generator().manual_seed(0)).tolist()
    runner = ModelRunner(model, num_blocks=8, block_size=16)
    out = runner.forward([Segment(ids, range(45), 0, [5, 2, 7], range(45))])[0]
    torch.testing.assert_close(out, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_incremental_decode_across_block_boundaries(pair):
    hf, model = pair
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(hf, ids)
    runner = ModelRunner(model, num_blocks=12, block_size=4)
    table = [6, 1, 11, 0, 3, 9, 2, 5, 4, 10]  # scattered, non-monotonic physical blocks
    runner.forward([Segment(ids[:9], range(9), 0, table, [])])
    for pos in range(9, 40):  # crosses 8 block boundaries of 4 tokens
        out = runner.forward([Segment([ids[pos]], [pos], pos, table, [0])])[0]
        torch.testing.assert_close(out[0], ref[pos], atol=ATOL, rtol=0)


def test_mixed_batch_of_four(pair):
    """Prompt prefill, a chunk after cached tokens, and decode tokens in one forward."""
    hf, model = pair
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (7, 23, 35, 18)]
    runner = ModelRunner(model, num_blocks=16, block_size=16)
    tables = [[0], [1, 2], [3, 4, 5], [6, 7]]
    cached = [0, 10, 34, 17]  # tokens already in the cache before the mixed step
    warm = [Segment(p[:c], range(c), 0, t, []) for p, c, t in zip(prompts, cached, tables) if c]
    runner.forward(warm)
    mixed = [Segment(p[c:], range(c, len(p)), c, t, range(len(p) - c))
             for p, c, t in zip(prompts, cached, tables)]
    outs = runner.forward(mixed)
    for p, c, out in zip(prompts, cached, outs):
        torch.testing.assert_close(out, hf_logits(hf, p)[c:], atol=ATOL, rtol=0)
