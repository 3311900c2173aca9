"""Qwen3 and Gemma 3 through the engine: greedy ids equal transformers' and equal with
speculation on (a draft of the same family, n-gram lookup) and off, batched, on the paged KV
cache; logits on every CPU kernel path (tests/model/test_cpu_stack.py: the C layer stack gives
the layers' own bits on these blocks)."""

from __future__ import annotations

import random

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.model.loader import load_model
from specserve.model.runner import ModelRunner, Segment
from tests.tiny_models import save_model

FAMILIES = ("qwen3", "gemma3")
MODES = ["chain:3", "tree:8", "ngram:3"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, target folder, 1-layer draft folder of the same family)."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    target = save_model(root / "target", arch, seed=11)
    # The draft's one layer is a sliding one for Gemma: its window applies in the draft too.
    extra = {"layer_types": ["sliding_attention"]} if arch == "gemma3" else {}
    draft = save_model(root / "draft", arch, seed=12, num_hidden_layers=1, **extra)
    return arch, target, draft


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Repeated phrases give the n-gram proposer something to find; lengths cross the window (8).
    return [([rng.randrange(3, 300) for _ in range(rng.randrange(3, 9))] * 4)[:rng.randrange(5, 30)]
            for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def hf_greedy(folder, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_equals_transformers_with_speculation_on_and_off(family):
    arch, target, draft = family
    ps = prompts(6, seed=3)
    want = [hf_greedy(target, p, GREEDY.max_tokens) for p in ps[:2]]
    plain = LLM(target, speculation="off", num_blocks=64, block_size=4)
    off = [o.token_ids for o in plain.generate(ps, GREEDY)]
    assert off[:2] == want
    spec = LLM(target, draft, num_blocks=96, block_size=4)
    for mode in MODES:
        outs = spec.generate(ps, GREEDY, speculation=mode)
        assert [o.token_ids for o in outs] == off, mode
        spec.engine.block_manager.check_no_leak()
    drafted = spec.generate(ps, GREEDY, speculation="chain:3")
    assert sum(o.metrics["num_draft_tokens"] for o in drafted) > 0


def test_logits_on_every_cpu_path(family, cpu_isa):
    """Prefill then decode past the window, on the C kernels of `cpu_isa` (fp32 dense weights:
    layer by layer), against transformers."""
    from transformers import AutoModelForCausalLM

    _, target, _ = family
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    model = load_model(target, dtype="float32")
    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    runner = ModelRunner(model, num_blocks=10, block_size=4)
    table = [7, 2, 9, 0, 4, 1, 8]
    out = runner.forward([Segment(ids[:10], range(10), 0, table, range(10))])[0]
    torch.testing.assert_close(out, ref[:10], atol=2e-5, rtol=0)
    for pos in range(10, 24):
        out = runner.forward([Segment([ids[pos]], [pos], pos, table, [0])])[0]
        torch.testing.assert_close(out[0], ref[pos], atol=2e-5, rtol=0)


def test_tree_nodes_window_by_depth_not_slot(tmp_path):
    """A tree's nodes sit at root + depth: the window counts positions, so a deep branch sees
    a sibling-free chain of ancestors exactly as the same tokens decoded in a line."""
    from transformers import AutoModelForCausalLM

    target = save_model(tmp_path / "g", "gemma3", seed=2)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    model = load_model(target, dtype="float32")
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    a, b, c = 40, 41, 42  # tree: root -> a -> c, root -> b (b is a sibling of a)
    runner = ModelRunner(model, num_blocks=12, block_size=4)
    table = list(range(12))
    runner.forward([Segment(ids[:-1], range(11), 0, table, [])])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    # rows: root (pos 11), a (12), b (12), c (13)
    out = runner.forward([Segment([ids[-1], a, b, c], [11, 12, 12, 13], 11, table,
                                  range(4), mask)])[0]
    with torch.no_grad():
        line = hf(torch.tensor([ids + [a, c]])).logits[0]
        side = hf(torch.tensor([ids + [b]])).logits[0]
    torch.testing.assert_close(out[[0, 1, 3]], line[[11, 12, 13]], atol=2e-5, rtol=0)
    torch.testing.assert_close(out[2], side[12], atol=2e-5, rtol=0)
