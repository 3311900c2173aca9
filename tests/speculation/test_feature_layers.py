"""EAGLE-3-style drafts that read several target layers (`target_feature_layers`): the target's
forward taps those layers' outputs (per-layer path and C layer stack alike), the draft fuses
them as its training twin does, the engine hands them over and stays lossless, and the recipe's
states carry them."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.draft_models.eagle_draft import EagleDraft, agreement, target_states
from specserve.kernels import cpu_decoder
from specserve.model.loader import CheckpointError, load_model
from specserve.model.runner import ModelRunner, Segment
from tests.speculation.test_eagle_draft import HEAD_IDS, hf, record_draft_reads
from tests.tiny_models import VOCAB, save_model, save_tokenizer

TAPS = (0, 1)  # of the 3-layer target: low and middle, beside the final state


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("fused") / "target", "llama", seed=0,
                      num_hidden_layers=3)


def hf_rows(target, ids) -> torch.Tensor:
    """[T, 3H]: transformers' final states, then the outputs of layers 0 and 1."""
    with torch.no_grad():
        out = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    states = out.hidden_states  # embeddings, layer 0, layer 1, final (normed)
    return torch.cat([out.last_hidden_state[0], states[1][0], states[2][0]], dim=-1)


def save_fused(target_dir, out, seed: int) -> tuple[EagleDraft, object]:
    torch.manual_seed(seed)
    twin = EagleDraft(hf(target_dir), 1, HEAD_IDS, (0,), feature_layers=TAPS)
    with torch.no_grad():
        twin.fc.weight.normal_(0, 0.08)
        twin.fuse.weight.normal_(0, 0.08)
    twin.save(out, {}, dtype=torch.float32)
    save_tokenizer(out)
    return twin, out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_targets_forward_taps_its_layers(target_dir, dtype):
    """bf16 runs the C layer stack in pieces (when the kernels build), float32 layer by layer;
    the final states are those of a forward without taps, bit for bit."""
    ids = [5, 17, 42, 99, 7, 300, 2]
    want = hf_rows(hf(target_dir), ids)
    model = load_model(target_dir, dtype=dtype)
    plain, tapped = [], []
    for out, taps in ((plain, ()), (tapped, TAPS)):
        runner = ModelRunner(model, num_blocks=4, block_size=16)
        runner.tap_layers(taps)
        for start, end in ((0, 5), (5, 7)):  # a prompt, then two rows over its cache
            seg = Segment(ids[start:end], range(start, end), start, [0], [end - start - 1],
                          hidden_rows=range(end - start))
            runner.forward([seg], out)
    plain, tapped = torch.cat(plain), torch.cat(tapped)
    H = model.spec.hidden_size
    assert tapped.shape == (len(ids), 3 * H)
    assert torch.equal(tapped[:, :H], plain)
    tol = 1e-4 if dtype == "float32" else 5e-2
    torch.testing.assert_close(tapped.float(), want, rtol=tol, atol=tol)
    if dtype == "bfloat16" and cpu_decoder.library() is not None:
        spans = {key[1:] for key in model.__dict__["_cpu_stacks"]}
        assert {(0, 1), (1, 2), (2, 3)} <= spans  # the stack ran in pieces


def test_tap_layers_refuses_what_the_model_lacks(target_dir):
    runner = ModelRunner(load_model(target_dir, dtype="float32"), num_blocks=2, block_size=16)
    for bad in ((1, 0), (0, 0), (3,), (-1,)):
        with pytest.raises(ValueError, match="distinct, ascending"):
            runner.tap_layers(bad)


def test_loaded_fused_draft_matches_its_training_twin(target_dir, tmp_path):
    twin, folder = save_fused(target_dir, tmp_path / "d", seed=4)
    target = load_model(target_dir, dtype="float32")
    draft = load_model(folder, dtype="float32", target=target)
    assert draft.spec.target_feature_layers == TAPS
    ids = [5, 17, 42, 99, 7]
    rows = hf_rows(hf(target_dir), ids)  # [T, 3H]
    with torch.no_grad():
        fused = twin.features(rows)
        torch.testing.assert_close(draft.fuse_target_features(rows), fused, rtol=1e-5, atol=1e-5)
        want = twin(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long),
                    fused[None])[0]
    hidden: list[torch.Tensor] = []
    seg = Segment(ids, range(len(ids)), 0, [0], [], hidden_rows=range(len(ids)),
                  target_hidden=fused)
    ModelRunner(draft, num_blocks=4, block_size=16).forward([seg], hidden)
    torch.testing.assert_close(hidden[0], want, rtol=1e-4, atol=1e-4)


def test_a_draft_reading_layers_the_target_lacks_is_refused(target_dir, tmp_path):
    _, folder = save_fused(target_dir, tmp_path / "d", seed=4)
    shallow = save_model(tmp_path / "t1", "llama", seed=0, num_hidden_layers=1)
    with pytest.raises(CheckpointError, match=r"reads target layers \[0, 1\]; the target has 1"):
        load_model(folder, dtype="float32", target=load_model(shallow, dtype="float32"))


@pytest.mark.parametrize("mode", ["chain:3", "tree:8", None])
def test_engine_feeds_the_fused_states_and_stays_lossless(target_dir, tmp_path, monkeypatch,
                                                          mode):
    twin, folder = save_fused(target_dir, tmp_path / "d", seed=5)
    prompts = [[5, 17, 42, 99], list(range(3, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in LLM(target_dir, dtype="float32").generate(prompts, params)]
    llm = LLM(target_dir, folder, dtype="float32", max_num_batched_tokens=16)  # chunked prompt
    seen = record_draft_reads(monkeypatch)
    reqs = [llm.engine.add_request(p, params, speculation=mode) for p in prompts]
    while llm.engine.has_work:
        llm.engine.step()
    assert [r.output_token_ids for r in reqs] == want
    assert llm.engine.stats.num_draft_tokens > 0
    target = hf(target_dir)
    for req in reqs:
        with torch.no_grad():
            fused = twin.features(hf_rows(target, req.all_token_ids))  # [T, H]
        rows = seen[req.request_id]
        assert len(rows) >= len(req.prompt_token_ids)
        for p, row in rows.items():
            if p > 0:
                torch.testing.assert_close(row, fused[p - 1], rtol=1e-4, atol=1e-4)
    llm.engine.block_manager.check_no_leak()


def test_recipe_states_carry_the_layers_and_a_plain_draft_grows_them(target_dir, tmp_path):
    """target_states(feature_layers) gives the engine's rows (cached under their own names);
    a fused draft started from a saved plain one computes what that one does."""
    g = torch.Generator().manual_seed(1)
    records = [{"prompt_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist(),
                "reply_ids": torch.randint(3, VOCAB, (m,), generator=g).tolist()}
               for n, m in [(5, 7), (9, 12)]]
    target = hf(target_dir)
    plain_states = target_states(target_dir, records, cache=tmp_path, log=lambda m: None)
    states = target_states(target_dir, records, cache=tmp_path, log=lambda m: None,
                           feature_layers=TAPS)
    assert len(list(tmp_path.glob("*-states-*.pt"))) == 2
    for r, got, plain in zip(records, states, plain_states):
        want = hf_rows(target, r["prompt_ids"] + r["reply_ids"])
        assert got.dtype == torch.float16 and got.shape == want.shape
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
        assert torch.equal(got[:, :plain.shape[1]], plain)

    torch.manual_seed(0)
    plain = EagleDraft(target, 1, HEAD_IDS, (0,))
    plain.save(tmp_path / "plain", {}, dtype=torch.float32)
    grown = EagleDraft(target, 1, HEAD_IDS, feature_layers=TAPS)
    grown.load_saved(tmp_path / "plain")
    assert agreement(grown, records, states) == agreement(plain, records, plain_states)
    with pytest.raises(ValueError, match="other target layers"):
        plain.load_saved(save_fused(target_dir, tmp_path / "fused", seed=6)[1])


def test_prompt_logprobs_beside_a_fused_draft(target_dir, tmp_path):
    """The target's hidden rows are wider with a fused draft; prompt and output log-probs
    still come from its final states alone."""
    _, folder = save_fused(target_dir, tmp_path / "d", seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, prompt_logprobs=2,
                            ignore_eos=True)
    prompt = list(range(3, 30))
    want = LLM(target_dir, dtype="float32").generate([prompt], params)[0]
    got = LLM(target_dir, folder, dtype="float32").generate([prompt], params,
                                                            speculation="chain:2")[0]
    assert got.token_ids == want.token_ids and got.metrics["num_drafts"] > 0
    for mine, theirs in ((got.prompt_logprobs[1:], want.prompt_logprobs[1:]),
                         (got.logprobs, want.logprobs)):
        assert len(mine) == len(theirs) > 0
        for a, b in zip(mine, theirs):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert abs(a.logprob - b.logprob) < 1e-4
