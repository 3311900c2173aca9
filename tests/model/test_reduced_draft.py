"""A draft with a reduced-vocabulary head that reads its target's embeddings (the default
model's draft is one): its logits, its loading, and lossless speculation with it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import LLM, SamplingParams
from specserve.model.loader import CheckpointError, load_model
from specserve.model.runner import ModelRunner, Segment
from specserve.speculation.proposers import DraftModelProposer
from tests.tiny_models import save_model

HEAD_IDS = torch.tensor(sorted({0, 1, 2, *range(3, 320, 3)}))  # 109 of the 320 tokens


def make_reduced_draft(full_draft, dst, target, head_ids=HEAD_IDS):
    """`full_draft` with the target's embeddings instead of its own and a head over `head_ids`:
    the same files the chat recipe writes."""
    shutil.copytree(full_draft, dst)
    state = load_file(full_draft / "model.safetensors")
    del state["model.embed_tokens.weight"]
    state["lm_head.weight"] = state["lm_head.weight"][head_ids].contiguous()
    state["lm_head.token_ids"] = head_ids.clone()
    save_file(state, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(draft_vocab_size=len(head_ids), shares_target_embeddings=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("reduced")
    target = save_model(base / "target", "llama", seed=0)
    full = save_model(base / "full", "llama", seed=1, num_hidden_layers=1)
    # The full draft with the target's embeddings: the reference for the reduced one.
    state = load_file(full / "model.safetensors")
    state["model.embed_tokens.weight"] = load_file(target / "model.safetensors")[
        "model.embed_tokens.weight"]
    save_file(state, full / "model.safetensors")
    return target, full, make_reduced_draft(full, base / "draft", target)


def test_logits_are_the_full_heads_rows_and_minus_inf_elsewhere(pair):
    target_dir, full_dir, draft_dir = pair
    target = load_model(target_dir, dtype="float32")
    draft = load_model(draft_dir, dtype="float32", target=target)
    full = load_model(full_dir, dtype="float32")
    assert draft.embed_tokens.weight is target.embed_tokens.weight  # shared, not copied
    ids = [5, 17, 42, 99, 7, 300, 2]
    seg = [Segment(ids, range(len(ids)), 0, [0], range(len(ids)))]
    got = ModelRunner(draft, num_blocks=4, block_size=16).forward(seg)[0]  # [T, vocab]
    ref = ModelRunner(full, num_blocks=4, block_size=16).forward(seg)[0]
    assert got.shape == ref.shape
    torch.testing.assert_close(got[:, HEAD_IDS], ref[:, HEAD_IDS], rtol=0, atol=1e-5)
    outside = torch.ones(got.shape[1], dtype=torch.bool)
    outside[HEAD_IDS] = False
    assert torch.isneginf(got[:, outside]).all()


def test_a_runner_of_head_rows_returns_the_heads_own_rows(pair):
    target_dir, _, draft_dir = pair
    target = load_model(target_dir, dtype="float32")
    draft = load_model(draft_dir, dtype="float32", target=target)
    ids = [5, 17, 42, 99, 7]
    seg = [Segment(ids, range(len(ids)), 0, [0], range(len(ids)))]
    vocab = ModelRunner(draft, num_blocks=4, block_size=16).forward(seg)[0]  # [T, vocab]
    runner = ModelRunner(draft, num_blocks=4, block_size=16, head_rows=True)
    rows = runner.forward(seg)[0]  # [T, head rows]
    assert runner.logit_width == len(HEAD_IDS) and rows.shape == (len(ids), len(HEAD_IDS))
    assert torch.equal(rows, vocab[:, HEAD_IDS])
    assert torch.equal(draft.vocab_logits(rows), vocab)
    assert runner.logits(torch.zeros(0, draft.spec.hidden_size)).shape == (0, len(HEAD_IDS))


def _proposed_trees(llm, prompts, params, mode):
    """Every tree the draft proposed while `llm` generated, in order: (tokens, parents)."""
    proposer = llm.engine.proposer
    trees, propose = [], proposer.propose

    def recording(inputs):
        proposal = propose(inputs)
        trees.extend((t.tokens, t.parents) for _, t in sorted(proposal.trees.items()))
        return proposal

    proposer.propose = recording
    try:
        out = llm.generate(prompts, params, speculation=mode)
    finally:
        proposer.propose = propose
    return trees, [o.token_ids for o in out]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_picked_from_head_rows_are_those_picked_from_the_vocabulary(pair, temperature):
    """The engine's draft runner returns the head's own rows (greedy picks read them as they
    are); one returning whole-vocabulary logits proposes the very same trees."""
    target_dir, _, draft_dir = pair
    by_rows = LLM(target_dir, draft_dir, dtype="float32")
    assert by_rows.engine.proposer.runner.head_rows
    by_vocab = LLM(target_dir, draft_dir, dtype="float32")
    old = by_vocab.engine.proposer.runner
    by_vocab.engine.proposer = DraftModelProposer(
        ModelRunner(old.model, old.kv_cache.shape[2], old.block_size))
    assert by_vocab.engine.proposer.column_tokens is None
    prompts = [[5, 17, 42, 99], [7, 300, 2, 11, 12, 13]]
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=20, ignore_eos=True)
    for mode in ("chain:3", "tree:8"):
        got = _proposed_trees(by_rows, prompts, params, mode)
        want = _proposed_trees(by_vocab, prompts, params, mode)
        assert got[0] and got == want, mode


def test_greedy_speculation_with_it_is_lossless(pair):
    target_dir, _, draft_dir = pair
    prompts = [[5, 17, 42, 99], [7, 300, 2, 11, 12, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    off = LLM(target_dir, dtype="float32").generate(prompts, params)
    llm = LLM(target_dir, draft_dir, dtype="float32")
    for mode in ("chain:4", "tree:8"):
        spec = llm.generate(prompts, params, speculation=mode)
        assert [o.token_ids for o in spec] == [o.token_ids for o in off], mode
        assert sum(o.metrics["num_drafts"] for o in spec) > 0


def test_sampling_with_it_runs(pair):
    target_dir, _, draft_dir = pair
    llm = LLM(target_dir, draft_dir, dtype="float32", speculation="chain:3")
    out = llm.generate([[5, 17, 42]], SamplingParams(temperature=1.0, seed=0, max_tokens=16,
                                                     ignore_eos=True))[0]
    assert len(out.token_ids) == 16 and all(0 <= t < 320 for t in out.token_ids)


def test_load_errors(pair, tmp_path):
    target_dir, full_dir, draft_dir = pair
    with pytest.raises(CheckpointError, match="uses its target's embeddings"):
        load_model(draft_dir)
    wide = save_model(tmp_path / "wide", "llama", seed=0, hidden_size=128)
    with pytest.raises(CheckpointError, match=r"target embeddings of shape \(320, 64\)"):
        load_model(draft_dir, target=load_model(wide))
    bad = make_reduced_draft(full_dir, tmp_path / "bad", target_dir)
    state = load_file(bad / "model.safetensors")
    state["lm_head.token_ids"] = HEAD_IDS + 300  # past the vocabulary
    save_file(state, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"lm_head\.token_ids.*token ids in \[0, 320\)"):
        load_model(bad, target=load_model(target_dir))
    state.pop("lm_head.token_ids")
    save_file(state, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors for: lm_head\.token_ids"):
        load_model(bad, target=load_model(target_dir))
