"""EAGLE-style drafts: a draft that reads the target's hidden states (the default model's draft
is one). Its loading against the training twin, the states the engine hands it, lossless greedy
and sampled speculation with it (batched, preempted, prefix-cached), and its distillation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.distributed import TPShard
from specserve.draft_models.eagle_draft import (
    EagleDraft,
    agreement,
    eagle_loss,
    state_batches,
    target_states,
)
from specserve.model.architectures import ArchSpec, DecoderLM
from specserve.model.loader import CheckpointError, load_hf_config, load_model
from specserve.model.runner import ModelRunner, Segment
from specserve.speculation.proposers import DraftModelProposer
from specserve.speculation.target_hidden import TargetHiddenStore
from tests.speculation.test_spec_sampling import P_MIN, chi2_p, sample
from tests.tiny_models import VOCAB, save_model, save_tokenizer

HEAD_IDS = torch.tensor(sorted({0, 1, 2, *range(3, VOCAB, 2)}))


def hf(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def save_eagle(target_dir, out, seed, head_ids=HEAD_IDS, num_layers=1, init_layers=(0,),
               copy=False):
    """An EAGLE draft for the checkpoint in `target_dir`. copy=True: the target itself in
    disguise (its layers, fc passing the token embedding through), so its states equal the
    target's and it drafts exactly what the target would say."""
    torch.manual_seed(seed)
    draft = EagleDraft(hf(target_dir), num_layers, head_ids, init_layers)
    with torch.no_grad():
        if copy:
            H = draft.fc.out_features
            draft.fc.weight.zero_()
            draft.fc.weight[:, :H] = torch.eye(H)
            draft.fc.bias.zero_()
        else:
            draft.fc.weight.normal_(0, 0.08)  # the feature half matters as much as the token's
    draft.save(out, {}, dtype=torch.float32)
    save_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("eagle")
    target = save_model(base / "target", "llama", seed=0)
    return target, save_eagle(target, base / "draft", seed=3)


@pytest.fixture(scope="module")
def greedy_reference(pair):
    prompts = [[5, 17, 42, 99], [7, 300, 2, 11, 12, 13], list(range(3, 60)), [9] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    off = LLM(pair[0], dtype="float32").generate(prompts, params)
    return prompts, params, [o.token_ids for o in off]


def record_draft_reads(monkeypatch) -> dict[str, dict[int, torch.Tensor]]:
    """request id -> position -> the row the draft read at that position, filled as it runs."""
    seen: dict[str, dict[int, torch.Tensor]] = {}
    read = DraftModelProposer._read_target_hidden

    def spy(self, request_id, start, end):
        rows = read(self, request_id, start, end)
        for i, p in enumerate(range(start, end)):
            seen.setdefault(request_id, {})[p] = rows[i]
        return rows

    monkeypatch.setattr(DraftModelProposer, "_read_target_hidden", spy)
    return seen


# ---- the store of target states -----------------------------------------------------------
def test_store_reach_inputs_and_trimming():
    store = TargetHiddenStore(2)
    assert store.reach("r") == 0
    rows = torch.arange(10.0).view(5, 2)  # positions 0..4
    store.record("r", 0, rows[:3])
    store.record("r", 3, rows[3:])
    assert store.reach("r") == 6  # position 5 reads the row of position 4
    got = store.inputs("r", 0, 6)  # positions 0..5 read rows of -1..4
    assert torch.equal(got[0], torch.zeros(2)) and torch.equal(got[1:], rows)
    store.drop_before("r", 4)
    assert torch.equal(store.inputs("r", 5, 6), rows[4:5])
    assert torch.equal(store.inputs("r", 2, 4), torch.zeros(2, 2))  # dropped: zeros
    assert store.reach("r") == 6


def test_store_recomputation_replaces_and_gaps_restart():
    store = TargetHiddenStore(1)
    store.record("r", 4, torch.ones(3, 1))  # a prefix-cache hit: rows start at 4
    assert torch.equal(store.inputs("r", 3, 8).flatten(), torch.tensor([0.0, 0, 1, 1, 1]))
    store.record("r", 5, torch.full((1, 1), 7.0))  # position 5 again: replaces 5 and drops 6
    assert store.reach("r") == 7
    store.record("r", 0, torch.full((2, 1), 2.0))  # a preempted request starts over
    assert store.reach("r") == 3
    store.record("r", 9, torch.full((1, 1), 3.0))  # a gap: only what follows counts
    assert store.reach("r") == 11 and torch.equal(store.inputs("r", 2, 3), torch.zeros(1, 1))
    store.forget("r")
    assert len(store) == 0 and store.reach("r") == 0


# ---- the model --------------------------------------------------------------------------
def test_loaded_draft_matches_its_training_twin(pair, tmp_path):
    target_dir, _ = pair
    target_hf = hf(target_dir)
    torch.manual_seed(4)
    twin = EagleDraft(target_hf, 1, HEAD_IDS, (1,))
    with torch.no_grad():
        twin.fc.weight.normal_(0, 0.08)
        twin.fc.bias.normal_(0, 0.08)
    twin.save(tmp_path / "d", {}, dtype=torch.float32)
    save_tokenizer(tmp_path / "d")
    target = load_model(target_dir, dtype="float32")
    draft = load_model(tmp_path / "d", dtype="float32", target=target)
    assert draft.embed_tokens.weight is target.embed_tokens.weight
    ids = [5, 17, 42, 99, 7, 300, 2]
    prev = torch.randn(len(ids), twin.fc.out_features)
    hidden: list[torch.Tensor] = []
    seg = Segment(ids, range(len(ids)), 0, [0], range(len(ids)), hidden_rows=range(len(ids)),
                  target_hidden=prev)
    logits = ModelRunner(draft, num_blocks=4, block_size=16).forward([seg], hidden)[0]
    with torch.no_grad():
        want = twin(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), prev[None])[0]
    torch.testing.assert_close(hidden[0], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[:, HEAD_IDS], twin.logits(want), rtol=1e-4, atol=1e-4)
    assert torch.isneginf(logits[:, 4]).all()  # outside the head: never drafted


def test_loading_errors(pair, tmp_path):
    target_dir, draft_dir = pair
    with pytest.raises(CheckpointError, match="load it together with its target"):
        load_model(draft_dir, dtype="float32")
    wide = save_model(tmp_path / "wide", "llama", seed=5, hidden_size=96)
    with pytest.raises(CheckpointError, match="embeddings of shape|hidden states of size 64"):
        load_model(draft_dir, dtype="float32", target=load_model(wide, dtype="float32"))
    spec = ArchSpec.from_hf_config(load_hf_config(draft_dir))
    with pytest.raises(ValueError, match="runs whole on rank 0"):
        DecoderLM(spec, torch.float32, TPShard(rank=0, world_size=2))


# ---- the engine ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["chain:4", "tree:8", "static:small", "adaptive", None])
def test_greedy_speculation_is_lossless(pair, greedy_reference, mode):
    prompts, params, want = greedy_reference
    llm = LLM(*pair, dtype="float32")
    outs = llm.generate(prompts, params, speculation=mode)
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics["num_drafts"] for o in outs) > 0
    assert len(llm.engine.proposer.target_hidden) == 0  # finished requests leave nothing
    llm.engine.block_manager.check_no_leak()


def test_lossless_under_preemption_prefix_hits_and_chunked_prompts(pair, greedy_reference):
    prompts, params, want = greedy_reference
    # 26 blocks of 4 tokens: the four requests need about 200 together, the longest 93 alone.
    llm = LLM(*pair, dtype="float32", num_blocks=26, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=16)
    # Twice over: the second round's prompts hit the prefix cache the first round filled.
    for _ in range(2):
        outs = llm.generate(prompts, params, speculation="tree:8")
        assert [o.token_ids for o in outs] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.prefix_hit_rate > 0
    llm.engine.block_manager.check_no_leak()


def test_engine_hands_the_draft_the_targets_states(pair, greedy_reference, monkeypatch):
    """Every state the draft reads is the target's own at the position before its token."""
    prompts, params, want = greedy_reference
    llm = LLM(*pair, dtype="float32", max_num_batched_tokens=32)  # the long prompt in chunks
    seen = record_draft_reads(monkeypatch)
    reqs = [llm.engine.add_request(p, params, speculation="chain:3") for p in prompts]
    while llm.engine.has_work:
        llm.engine.step()
    target = hf(pair[0])
    for req, expected in zip(reqs, want):
        assert req.output_token_ids == expected
        seq = torch.tensor([req.all_token_ids])
        with torch.no_grad():
            states = target.model(input_ids=seq).last_hidden_state[0]  # [T, H]
        rows = seen[req.request_id]
        assert len(rows) >= len(req.prompt_token_ids)  # the whole prompt, and decode steps
        assert torch.equal(rows[0], torch.zeros_like(rows[0]))
        for p, row in rows.items():
            if p > 0:
                torch.testing.assert_close(row, states[p - 1], rtol=1e-4, atol=1e-4)


def test_copy_draft_accepts_everything(tmp_path):
    target = save_model(tmp_path / "t", "llama", seed=0)
    draft = save_eagle(target, tmp_path / "d", seed=0, head_ids=torch.arange(VOCAB),
                       num_layers=2, init_layers=(0, 1), copy=True)
    llm = LLM(target, draft, dtype="float32")
    for k in (2, 4):
        params = SamplingParams(temperature=0, max_tokens=1 + 5 * (k + 1), ignore_eos=True)
        out = llm.generate([[7, 8, 9, 10]], params, speculation=f"chain:{k}")[0]
        assert out.metrics["num_accepted_tokens"] == 5 * k
        assert out.metrics["acceptance_length"] == k + 1


@pytest.mark.slow
def test_sampling_keeps_the_target_distribution(tmp_path):
    target = save_model(tmp_path / "t", "llama", seed=21, vocab_size=24, eos_token_id=2)
    draft = save_eagle(target, tmp_path / "d", seed=22, head_ids=torch.arange(24))
    ref, _ = sample(target, None, "off", n=1500)
    got, stats = sample(target, draft, "chain:3", n=1500, seed0=10_000)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both paths ran
    for pos in range(1, 4):
        p = chi2_p([r[pos] for r in ref], [g[pos] for g in got])
        assert p > P_MIN, (pos, p)


# ---- distillation -------------------------------------------------------------------------
def test_target_states_are_the_served_models_final_states(pair):
    """The recipe's states come from the model as specserve serves it, batched into forwards of
    about `batch_tokens` (here several records per forward, and records across blocks): each
    record's rows are its own prompt + reply's final hidden states, as transformers computes
    them from the same weights."""
    target_dir, _ = pair
    target = hf(target_dir)
    g = torch.Generator().manual_seed(1)
    records = [{"prompt_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist(),
                "reply_ids": torch.randint(3, VOCAB, (m,), generator=g).tolist()}
               for n, m in [(5, 7), (17, 20), (3, 1), (9, 30), (2, 2)]]
    logged = []
    states = target_states(target_dir, records, batch_tokens=48, block_size=8,
                           log=logged.append)
    assert len(logged) > 1  # more than one forward
    for r, got in zip(records, states):
        seq = torch.tensor([r["prompt_ids"] + r["reply_ids"]])
        with torch.no_grad():
            want = target.model(input_ids=seq).last_hidden_state[0]  # [T, H]
        assert got.dtype == torch.float16 and got.shape == want.shape
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_target_states_go_on_from_their_cached_chunks(pair, tmp_path):
    """With a cache folder the states are saved in chunks named by their records: a run that
    stopped after some chunks (here: a corpus of the first four records) has them read back,
    and only the rest is computed."""
    target_dir, _ = pair
    g = torch.Generator().manual_seed(2)
    records = [{"prompt_ids": torch.randint(3, VOCAB, (4 + i,), generator=g).tolist(),
                "reply_ids": torch.randint(3, VOCAB, (6,), generator=g).tolist()}
               for i in range(7)]
    uncached = target_states(target_dir, records, log=lambda m: None)
    target_states(target_dir, records[:4], cache=tmp_path, chunk=2, log=lambda m: None)
    assert len(list(tmp_path.glob("*-states-*.pt"))) == 2
    logged = []
    states = target_states(target_dir, records, cache=tmp_path, chunk=2, log=logged.append)
    assert sum("(cached)" in m for m in logged) == 2  # records 0-3 read back
    assert len(list(tmp_path.glob("*-states-*.pt"))) == 4  # 4-5 and 6 computed and saved
    assert not list(tmp_path.glob("*.tmp"))
    assert [s.shape for s in states] == [s.shape for s in uncached]
    for got, want in zip(states, uncached):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    # Read back or just computed, every state is mapped from its chunk's file, not held in memory.
    cache_maps = file_mappings(tmp_path)
    assert all(any(lo <= s.data_ptr() < hi for lo, hi in cache_maps) for s in states)


def file_mappings(folder) -> list[tuple[int, int]]:
    """The address ranges this process has mapped from files in `folder` (Linux)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(str(folder)):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    return ranges


def test_distillation_learns_the_targets_states(pair):
    target_dir, _ = pair
    target = hf(target_dir)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, VOCAB, (24, 6), generator=g)
    with torch.no_grad():  # the target's own greedy replies, as the recipe's data
        replies = target.generate(prompts, attention_mask=torch.ones_like(prompts),
                                  max_new_tokens=10, min_new_tokens=10, do_sample=False)[:, 6:]
    records = [{"prompt_ids": p.tolist(), "reply_ids": r.tolist()}
               for p, r in zip(prompts, replies)]
    states = target_states(target_dir, records, log=lambda m: None)
    assert [len(s) for s in states] == [16] * 24
    torch.manual_seed(0)
    draft = EagleDraft(target, 1, torch.arange(VOCAB), (0,))
    before = agreement(draft, records, states, depth=2)
    opt = torch.optim.AdamW(draft.trainable(), lr=3e-3)
    batches = state_batches(records, states, 8, seed=0)
    losses = []
    for _ in range(60):
        loss, per_pass = eagle_loss(draft, next(batches), unroll=2, cls_weight=0.1)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        assert len(per_pass) == 2
    after = agreement(draft, records, states, depth=2)
    assert sum(losses[-5:]) < 2 / 3 * sum(losses[:5])
    assert after[0] > before[0] + 0.2, (before, after)  # the training replies: it fits them


def test_loss_weights_scale_their_own_terms(pair):
    """reg_weight scales the hidden-state regression alone, cls_weight the next-token loss
    alone; with reg_weight 0 the loss is the cross-entropy against the target's distribution."""
    target_dir, _ = pair
    target = hf(target_dir)
    g = torch.Generator().manual_seed(1)
    records = [{"prompt_ids": torch.randint(3, VOCAB, (5,), generator=g).tolist(),
                "reply_ids": torch.randint(3, VOCAB, (7,), generator=g).tolist()}
               for _ in range(4)]
    states = target_states(target_dir, records, log=lambda m: None)
    torch.manual_seed(0)
    draft = EagleDraft(target, 1, HEAD_IDS, (0,))
    batch = next(state_batches(records, states, 4, seed=0))
    with torch.no_grad():
        both, measured = eagle_loss(draft, batch, unroll=1, cls_weight=0.3, reg_weight=2.0)
        unmeasured = eagle_loss(draft, batch, unroll=1, cls_weight=0.3, reg_weight=2.0,
                                measure_agreement=False)
        reg_only, _ = eagle_loss(draft, batch, unroll=1, cls_weight=0.0, reg_weight=1.0)
        cls_only, _ = eagle_loss(draft, batch, unroll=1, cls_weight=1.0, reg_weight=0.0)
        ids, mask, prev, f, loss_mask = batch
        h = draft(ids, mask, prev)[loss_mask]
        want_p = torch.softmax(draft.logits(f[loss_mask]), dim=-1)
        ce = -(want_p * torch.log_softmax(draft.logits(h), dim=-1)).sum(-1).mean()
    assert reg_only > 0 and cls_only > 0
    torch.testing.assert_close(cls_only, ce)
    torch.testing.assert_close(both, 2.0 * reg_only + 0.3 * cls_only)
    assert len(measured) == 1 and unmeasured[1] == []  # the agreement only when asked for
    torch.testing.assert_close(unmeasured[0], both)
