"""The default model's draft training (draft_models/chat_recipe.py) on a tiny target: a run
killed mid-way goes on from its last checkpoint to the weights an uninterrupted run reaches."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from draft_models.chat_recipe import acceptance_per_depth, train, write_acceptance_prior
from draft_models.eagle_draft import EagleDraft, state_batches, target_states


@pytest.fixture(scope="module")
def setup(tiny_target: Path):
    target = LlamaForCausalLM.from_pretrained(tiny_target).eval()
    gen = torch.Generator().manual_seed(0)
    records = [{"prompt_ids": torch.randint(3, 300, (5,), generator=gen).tolist(),
                "reply_ids": torch.randint(3, 300, (7,), generator=gen).tolist()}
               for _ in range(8)]
    return target, records, target_states(tiny_target, records, log=lambda m: None)


def fresh_draft(target) -> EagleDraft:
    torch.manual_seed(0)
    return EagleDraft(target, 1, torch.arange(3, 103), init_layers=[0])


class Killed(Exception):
    pass


def killed_after(batches, n: int):
    yield from itertools.islice(batches, n)
    raise Killed


def run(setup, tmp_path, checkpoint, batches_of=lambda b: b) -> dict[str, torch.Tensor]:
    target, records, states = setup
    draft = fresh_draft(target)
    train(draft, batches_of(state_batches(records, states, 2, seed=0)), steps=6, lr=1e-3,
          warmup=2, unroll=2, cls_weight=0.1, log_path=tmp_path / "loss.csv", start=0.0,
          checkpoint=checkpoint, save_every=2)
    return {k: v.clone() for k, v in draft.state_dict().items()}


def test_a_killed_run_goes_on_to_the_uninterrupted_weights(setup, tmp_path):
    whole = run(setup, tmp_path / "a", checkpoint=None)
    checkpoint = tmp_path / "b" / "train.pt"
    checkpoint.parent.mkdir()
    with pytest.raises(Killed):  # killed at step 3: steps 0..2 done, the checkpoint after 1
        run(setup, tmp_path / "b", checkpoint, lambda b: killed_after(b, 3))
    assert torch.load(checkpoint)["step"] == 2
    resumed = run(setup, tmp_path / "b", checkpoint)
    assert torch.load(checkpoint)["step"] == 6
    assert whole.keys() == resumed.keys()
    changed = [k for k in whole if not torch.equal(whole[k], fresh_draft(setup[0]).state_dict()[k])]
    assert "fc.weight" in changed  # training moved the weights: the comparison means something
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), k
    # The loss log holds each step once: step 2, logged before the kill, was done again.
    log = (tmp_path / "b" / "loss.csv").read_text().splitlines()
    assert log[0].startswith("step,") and [row.split(",")[0] for row in log[1:]] == \
        ["0", "1", "2", "3", "4", "5"]


def test_acceptance_per_depth_is_conditional_and_leaves_out_thin_depths():
    """The shipped draft's measurement: 497 drafts, accepted at depth 1..4: 131, 32, 6, 3;
    depth 4 rests on 6 drafts, too few."""
    rates = acceptance_per_depth(497, [131, 32, 6, 3])
    assert [round(a, 3) for a in rates] == [0.264, 0.244, 0.188]
    assert acceptance_per_depth(5, [3, 1]) == []
    assert acceptance_per_depth(100, [0, 0]) == [0.0]  # nothing reached depth 2


class Output:
    def __init__(self, drafts, accepted):
        self.metrics = {"num_drafts": drafts, "accepted_per_pos": accepted}


def test_the_prior_is_written_where_the_engine_reads_it(tmp_path):
    from specserve.speculation.adaptive import MAX_CHAIN, acceptance_prior

    outs = [Output(300, [100, 40, 5]), Output(197, [31, 12, 3, 1])]
    prior = write_acceptance_prior(tmp_path, outs, "a test")
    assert prior["acceptance_per_depth"] == [round(131 / 497, 3), round(52 / 131, 3),
                                             round(8 / 52, 3)]
    assert "131, 52, 8, 1" in prior["measured"]
    assert acceptance_prior(tmp_path) == pytest.approx(
        prior["acceptance_per_depth"] + [prior["acceptance_per_depth"][-1]] * (MAX_CHAIN - 3))
    with pytest.raises(ValueError, match="too few drafts"):
        write_acceptance_prior(tmp_path, [Output(3, [1])], "a test")


def test_training_goes_on_from_a_saved_draft(setup, tmp_path):
    """--init-draft: a fresh draft given a saved one's weights computes what the saved one
    does (to bf16, the saved dtype); a draft whose head has other tokens is refused."""
    target, records, states = setup
    trained = fresh_draft(target)
    train(trained, state_batches(records, states, 2, seed=0), steps=4, lr=1e-3, warmup=1,
          unroll=1, cls_weight=0.1, log_path=None, start=0.0)
    trained.save(tmp_path / "draft", {})
    assert torch.equal(EagleDraft.saved_token_ids(tmp_path / "draft"), trained.token_ids)
    again = EagleDraft(target, 1, trained.token_ids)
    again.load_saved(tmp_path / "draft")
    ids, mask, prev, _, _ = next(state_batches(records, states, 4, seed=1))
    with torch.no_grad():
        want, got = trained(ids, mask, prev), again(ids, mask, prev)
        fresh = fresh_draft(target)(ids, mask, prev)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    assert (got - want).abs().max() < (fresh - want).abs().max() / 5  # not just any draft
    other = EagleDraft(target, 1, torch.arange(4, 104))
    with pytest.raises(ValueError, match="other tokens"):
        other.load_saved(tmp_path / "draft")
    # Grown one layer deeper, it starts as the saved draft; the new layer is then trainable.
    deeper = EagleDraft(target, 2, trained.token_ids)
    deeper.load_saved(tmp_path / "draft")
    with torch.no_grad():
        torch.testing.assert_close(deeper(ids, mask, prev), got)
    assert deeper.model.layers[1].mlp.down_proj.weight.requires_grad
    deeper.save(tmp_path / "deeper", {})
    with pytest.raises(ValueError, match="layers differ"):
        again.load_saved(tmp_path / "deeper")


def test_bf16_training_tracks_float32_and_keeps_float32_weights(setup, tmp_path):
    """--precision bf16: the loss runs under autocast (bf16 products) while the weights and the
    optimizer stay float32; the losses follow the float32 run's closely, yet not exactly (the
    products did run in bf16)."""
    target, records, states = setup
    losses = {}
    for bf16 in (False, True):
        draft = fresh_draft(target)
        log_path = tmp_path / f"loss-{bf16}.csv"
        train(draft, state_batches(records, states, 2, seed=0), steps=6, lr=1e-3, warmup=2,
              unroll=2, cls_weight=0.1, log_path=log_path, start=0.0, bf16=bf16)
        assert all(p.dtype == torch.float32 for p in draft.trainable())
        rows = log_path.read_text().splitlines()
        column = rows[0].split(",").index("loss")
        losses[bf16] = torch.tensor([float(r.split(",")[column]) for r in rows[1:]])
    assert len(losses[True]) == 6
    torch.testing.assert_close(losses[True], losses[False], rtol=0.03, atol=0.01)
    assert not torch.equal(losses[True], losses[False])


def test_length_windows_batch_records_of_like_length_and_see_each_once_a_pass():
    """state_batches(length_window=w): each pass still holds every record once (all but the
    last partial batch), batches hold records of similar lengths, so they pad less than batches
    drawn at random, and the order of records changes from pass to pass."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 200, (64,), generator=gen).tolist()
    records = [{"prompt_ids": [7] * 2, "reply_ids": list(range(n))} for n in lengths]
    states = [torch.full((n + 2, 3), float(i)) for i, n in enumerate(lengths)]

    def passes(window: int) -> list[list[list[int]]]:
        batches = state_batches(records, states, 4, seed=0, length_window=window)
        # a record's index is its states' value (in every real position of its row)
        return [[[int(b[3][r, 0, 0]) for r in range(4)] for b in itertools.islice(batches, 16)]
                for _ in range(2)]

    def padding(batches) -> int:
        return sum(4 * max(lengths[j] for j in b) - sum(lengths[j] for j in b) for b in batches)

    for window in (1, 4):
        first, second = passes(window)
        assert sorted(j for b in first for j in b) == list(range(64))
        assert sorted(j for b in second for j in b) == list(range(64))
        assert first != second
    windowed, random = passes(4)[0], passes(1)[0]
    assert padding(windowed) < padding(random) / 2
    with pytest.raises(ValueError, match="length_window 0"):
        next(state_batches(records, states, 4, seed=0, length_window=0))
