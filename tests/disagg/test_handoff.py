"""Engine-level disaggregation: prefill on one engine, export, transfer over a real socket,
import, decode on another engine == one colocated engine, token for token, in every mode; no
block is left held on either side."""

from __future__ import annotations

import socket
import threading

import pytest

from specserve import LLM, SamplingParams
from specserve.disagg.handoff import PrefillHandoff, import_prefilled
from specserve.disagg.prefill import SAMPLING_FIELDS, prefill_params
from specserve.disagg.transport import KVPayload, receive_payload, send_payload
from tests.engine.test_engine import mixed_prompts
from tests.speculation.test_eagle_draft import save_eagle

GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
OPTIONS = dict(max_num_batched_tokens=48, num_blocks=96, block_size=8)  # noqa: C408
LONG = mixed_prompts(1, seed=3)[0] * 4  # 68 tokens: two prefill chunks of 48 at most
MODES = ["off", "chain:3", "tree:8", "adaptive", "suffix", "ngram:3"]


@pytest.fixture(scope="module")
def eagle_draft(tiny_target, tmp_path_factory):
    return save_eagle(tiny_target, tmp_path_factory.mktemp("eagle") / "draft", seed=3)


@pytest.fixture(scope="module", params=["draft-model", "eagle"])
def trio(request, tiny_target, tiny_draft, eagle_draft):
    """(colocated, prefill, decode) engines of one target with one kind of draft."""
    draft = tiny_draft if request.param == "draft-model" else eagle_draft
    return tuple(LLM(tiny_target, draft, **OPTIONS) for _ in range(3))


def over_socket(payload: KVPayload) -> KVPayload:
    """The payload after a trip through the TCP framing."""
    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=send_payload, args=(a, payload))
        sender.start()
        got = receive_payload(b)
        sender.join()
    return got


def prefill(llm: LLM, prompt, params: SamplingParams, speculation) -> KVPayload:
    """What a prefill server does for one prompt, run inline."""
    core = llm.engine
    handoff = PrefillHandoff(core, run_on_engine=lambda fn: fn(core))
    sampling = {k: getattr(params, k) for k in SAMPLING_FIELDS}  # what a decode server sends
    req = core.make_request(prompt, prefill_params(sampling), speculation=speculation)
    req.kv_hold = True
    core.add(req)
    while core.has_work:
        core.step()
    blocks = core.block_manager
    assert handoff.num_held == 1 and blocks.num_free_blocks < blocks.num_blocks  # still held
    payload = handoff.export(req.request_id)
    handoff.release(req.request_id)
    core.block_manager.check_no_leak()  # released: every block is back
    return over_socket(payload)


def decode(llm: LLM, items) -> list[list[int]]:
    """Import each (prompt, params, speculation, payload), then step until all are done."""
    core = llm.engine
    tokens: dict[str, list[int]] = {}
    for prompt, params, speculation, payload in items:
        req = core.make_request(prompt, params, speculation=speculation)
        tokens[req.request_id] = []
        for delta in import_prefilled(core, req, payload):
            tokens[delta.request_id] += delta.token_ids
    while core.has_work:
        for delta in core.step():
            tokens[delta.request_id] += delta.token_ids
    core.block_manager.check_no_leak()
    return list(tokens.values())


@pytest.mark.parametrize("mode", MODES)
def test_disaggregated_equals_colocated(trio, mode):
    colocated, pre, dec = trio
    prompts = mixed_prompts(3, seed=11) + [LONG]
    expected = [o.token_ids for o in colocated.generate(prompts, GREEDY, speculation=mode)]
    items = [(p, GREEDY, mode, prefill(pre, p, GREEDY, mode)) for p in prompts]
    assert decode(dec, items) == expected


def test_the_draft_state_travels(trio):
    """A draft model's prompt KV comes along; an EAGLE draft's target states do instead."""
    _, pre, _ = trio
    prompt = LONG[::-1]  # not prefilled before: no prefix-cache hit (whose rows are zeros)
    payload = prefill(pre, prompt, GREEDY, "chain:3")
    n = len(prompt)
    assert payload.meta.num_prompt_tokens == n
    assert payload.tensors["target_kv"].shape[2] == -(-n // 8)  # [L, 2, blocks, bs, Hkv, D]
    if pre.engine.proposer.reads_target_hidden:
        hidden = payload.tensors["target_hidden"]
        H = pre.engine.target.spec.hidden_size
        assert hidden.shape == (n - payload.meta.hidden_start, H)
        assert hidden.abs().sum(-1).gt(0).all()  # real states, not the zeros of missing rows
    else:
        assert payload.meta.num_draft_computed == n and "target_hidden" not in payload.tensors


def test_seeded_sampling_continues_the_same_stream(trio):
    colocated, pre, dec = trio
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16,
                            ignore_eos=True)
    prompt = mixed_prompts(1, seed=21)[0]
    # A fixed mode: adaptive speculation picks chain lengths from each engine's own timings,
    # and the draft's proposals decide which random draws a sampled step makes.
    mode = "chain:3"
    expected = colocated.generate([prompt], params, speculation=mode)[0].token_ids
    assert decode(dec, [(prompt, params, mode, prefill(pre, prompt, params, mode))]) == [expected]


def test_first_token_that_ends_the_request(trio):
    colocated, pre, dec = trio
    params = SamplingParams(temperature=0.0, max_tokens=1)
    prompt = mixed_prompts(1, seed=8)[0]
    expected = colocated.generate([prompt], params)[0].token_ids
    assert decode(dec, [(prompt, params, None, prefill(pre, prompt, params, None))]) == [expected]


def test_no_room_on_the_decode_side_recomputes(tiny_target):
    """A decode pool too full for the transfer: the request waits without it and recomputes
    its prompt, like a preempted request; the output does not change."""
    colocated, pre = LLM(tiny_target, **OPTIONS), LLM(tiny_target, **OPTIONS)
    dec = LLM(tiny_target, **{**OPTIONS, "num_blocks": 8})
    prompt = LONG[:40]  # 5 blocks of 8
    expected = colocated.generate([prompt], GREEDY)[0].token_ids
    payload = prefill(pre, prompt, GREEDY, None)
    core = dec.engine
    hog = core.block_manager.allocate(4)  # 4 of 8 blocks free: 5 needed
    req = core.make_request(prompt, GREEDY)
    tokens = [t for d in import_prefilled(core, req, payload) for t in d.token_ids]
    assert req.block_table == [] and req.num_computed_tokens == 0  # waits without KV
    core.block_manager.free_blocks(hog)
    while core.has_work:
        tokens += [t for d in core.step() for t in d.token_ids]
    assert tokens == expected
    core.block_manager.check_no_leak()


def test_a_transfer_that_does_not_fit_is_refused(trio):
    _, pre, dec = trio
    prompt = mixed_prompts(1, seed=8)[0]
    payload = prefill(pre, prompt, GREEDY, None)
    req = dec.engine.make_request(prompt + [5], GREEDY)
    with pytest.raises(ValueError, match="does not fit a request"):
        import_prefilled(dec.engine, req, payload)
    dec.engine.block_manager.check_no_leak()


def test_prefix_cache_hits_on_the_prefill_side(tiny_target, tiny_draft):
    """A prompt that shares a prefix with an earlier one is read from the prefill engine's prefix
    cache; the KV it sends is the same, and so is the output."""
    colocated, pre, dec = (LLM(tiny_target, tiny_draft, **OPTIONS) for _ in range(3))
    second = LONG + [9, 10, 11]
    expected = colocated.generate([second], GREEDY, speculation="chain:3")[0].token_ids
    prefill(pre, LONG, GREEDY, "chain:3")
    payload = prefill(pre, second, GREEDY, "chain:3")
    assert pre.engine.block_manager.prefix_hits == len(LONG) // 8  # every full block
    assert decode(dec, [(second, GREEDY, "chain:3", payload)]) == [expected]
